"""A checkpoint's small files (config, tokenizer, generation config): list them, fetch one.

An engine worker that takes its weights from a rank shard still needs these in a local directory
(`reshard.format.meta_files`); with them from here, a worker needs nothing but the checkpoint's URL.
"""

from __future__ import annotations

import os
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Path
from fastapi.responses import FileResponse, Response

from reshard.errors import NotFoundError
from reshard.format.meta_files import MAX_META_BYTES, META_NAMES, META_PATTERN, is_meta_file
from reshard.io.hashing import file_sha256
from reshard.service.api.deps import CatalogDep, Name, off_loop
from reshard.service.api.schemas import MetaList
from reshard.service.catalog import LRU
from reshard.service.http_errors import BadRequest, PayloadTooLarge, error_responses

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"])
SHA_HEADER = "x-reshard-sha256"


_DIGESTS: LRU[tuple[str, int, int, int, int], str] = LRU(1024)  # by (path, device, inode, size, mtime_ns)


def _digest(path: FsPath, st: os.stat_result) -> str:
    """The sha256 of a small file, hashed in blocks once per version of it (its stat identity)."""
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    sha = _DIGESTS.get(key)
    if sha is None:
        sha = file_sha256(path)
        _DIGESTS.put(key, sha)
    return sha


def _listing(directory: FsPath) -> list[dict[str, Any]]:
    out = []
    for name in META_NAMES:
        path = directory / name
        if path.is_file() and not path.is_symlink():
            st = path.stat()
            if st.st_size <= MAX_META_BYTES:
                out.append({"name": name, "size": st.st_size, "sha256": _digest(path, st)})
    return out


@router.get("/{name}/meta", response_model=MetaList, summary="The checkpoint's small files (config, tokenizer)",
            description=f"Which of {', '.join(META_NAMES)} the checkpoint has, with sizes and sha256.",
            responses=error_responses(400, 401, 404))
async def list_meta(name: Name, catalog: CatalogDep) -> dict[str, Any]:
    directory = await off_loop(catalog.directory, name)
    return {"name": name, "files": await off_loop(_listing, directory)}


def _file(directory: FsPath, name: str, filename: str) -> tuple[FsPath, os.stat_result, str]:
    if not is_meta_file(filename):
        raise BadRequest(f"{filename!r} is not one of a checkpoint's small files ({', '.join(META_NAMES)})")
    path = directory / filename
    if not path.is_file() or path.is_symlink():
        raise NotFoundError(f"checkpoint {name!r} has no {filename}; GET /v1/checkpoints/{name}/meta lists its files")
    st = path.stat()
    if st.st_size > MAX_META_BYTES:
        raise PayloadTooLarge(f"checkpoint {name!r}: {filename} is {st.st_size} bytes, over the {MAX_META_BYTES} served")
    return path, st, _digest(path, st)


@router.get("/{name}/meta/{filename}", summary="One small file of the checkpoint",
            response_class=Response, responses={
                200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                      "description": "the file's bytes"}, **error_responses(400, 401, 404, 413)})
async def get_meta(name: Name, filename: Annotated[str, Path(json_schema_extra={"pattern": META_PATTERN})],
                   catalog: CatalogDep) -> Response:
    directory = await off_loop(catalog.directory, name)
    path, st, sha = await off_loop(_file, directory, name, filename)
    # streamed from the file in blocks (never whole in memory); the digest is the cached one of this version
    return FileResponse(path, stat_result=st, media_type="application/octet-stream", headers={SHA_HEADER: sha})
