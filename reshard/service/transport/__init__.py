"""Shard bodies on the wire: uvicorn's protocol with bounded heads, zero-copy sends, the body pump."""
