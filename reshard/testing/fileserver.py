"""A static file server on FastAPI's `FileResponse` (Starlette: one range or several, ETag, Last-Modified):
the plain-HTTP store of the io tests and the `FileResponse` baseline of the service benchmark.

    python -m reshard.testing.fileserver --root DIR --port 8001    # GET/HEAD /files/NAME, GET /healthz
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse


def file_app(root: Path | str) -> FastAPI:
    """An app serving the files under `root` at `/files/{name}` (404 outside `root` or for a directory)."""
    base = Path(root).resolve()
    app = FastAPI()

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route("/files/{name:path}", methods=["GET", "HEAD"])
    def get_file(name: str) -> FileResponse:
        path = (base / name).resolve()
        if not path.is_relative_to(base) or not path.is_file():
            raise HTTPException(404, f"{name}: no such file")
        return FileResponse(path, media_type="application/octet-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(prog="python -m reshard.testing.fileserver")
    p.add_argument("--root", default=".")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    # as `uvicorn APP --host 127.0.0.1 --port P --log-level warning --no-access-log`
    uvicorn.run(file_app(args.root), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
