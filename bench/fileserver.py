"""The FastAPI `FileResponse` baseline: serves the files of `$BENCH_FILE_ROOT` at `/files/{name}`.

    BENCH_FILE_ROOT=DIR python -m uvicorn bench.fileserver:app --port 8001
"""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse

ROOT = Path(os.environ.get("BENCH_FILE_ROOT", ".")).resolve()

app = FastAPI()


@app.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@app.api_route("/files/{name:path}", methods=["GET", "HEAD"])
def get_file(name: str) -> FileResponse:
    path = (ROOT / name).resolve()
    if not path.is_relative_to(ROOT) or not path.is_file():
        raise HTTPException(404, f"{name}: no such file")
    return FileResponse(path, media_type="application/octet-stream")
