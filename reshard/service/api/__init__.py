"""The FastAPI app: `create_app`, its routers, dependencies, schemas and middleware."""
