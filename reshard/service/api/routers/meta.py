"""A checkpoint's small files (config, tokenizer, generation config): list them, fetch one.

An engine worker that takes its weights from a rank shard still needs these in a local directory
(`reshard.format.meta_files`); with them from here, a worker needs nothing but the checkpoint's URL.
"""

from __future__ import annotations

import hashlib
from pathlib import Path as FsPath
from typing import Annotated, Any

from fastapi import APIRouter, Path
from fastapi.responses import Response

from reshard.errors import NotFoundError
from reshard.format.meta_files import MAX_META_BYTES, META_NAMES, META_PATTERN, is_meta_file
from reshard.service.api.deps import CatalogDep, Name, off_loop
from reshard.service.api.schemas import MetaList
from reshard.service.http_errors import BadRequest, PayloadTooLarge, error_responses

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"])
SHA_HEADER = "x-reshard-sha256"


def _listing(directory: FsPath) -> list[dict[str, Any]]:
    out = []
    for name in META_NAMES:
        path = directory / name
        if path.is_file() and not path.is_symlink():
            if path.stat().st_size <= MAX_META_BYTES:
                out.append({"name": name, "size": path.stat().st_size,
                            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()})
    return out


@router.get("/{name}/meta", response_model=MetaList, summary="The checkpoint's small files (config, tokenizer)",
            description=f"Which of {', '.join(META_NAMES)} the checkpoint has, with sizes and sha256.",
            responses=error_responses(400, 401, 404))
async def list_meta(name: Name, catalog: CatalogDep) -> dict[str, Any]:
    directory = await off_loop(catalog.directory, name)
    return {"name": name, "files": await off_loop(_listing, directory)}


def _read(directory: FsPath, name: str, filename: str) -> bytes:
    if not is_meta_file(filename):
        raise BadRequest(f"{filename!r} is not one of a checkpoint's small files ({', '.join(META_NAMES)})")
    path = directory / filename
    if not path.is_file() or path.is_symlink():
        raise NotFoundError(f"checkpoint {name!r} has no {filename}; GET /v1/checkpoints/{name}/meta lists its files")
    size = path.stat().st_size
    if size > MAX_META_BYTES:
        raise PayloadTooLarge(f"checkpoint {name!r}: {filename} is {size} bytes, over the {MAX_META_BYTES} served")
    return path.read_bytes()


@router.get("/{name}/meta/{filename}", summary="One small file of the checkpoint",
            response_class=Response, responses={
                200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                      "description": "the file's bytes"}, **error_responses(400, 401, 404, 413)})
async def get_meta(name: Name, filename: Annotated[str, Path(json_schema_extra={"pattern": META_PATTERN})],
                   catalog: CatalogDep) -> Response:
    directory = await off_loop(catalog.directory, name)
    data = await off_loop(_read, directory, name, filename)
    return Response(data, media_type="application/octet-stream",
                    headers={SHA_HEADER: hashlib.sha256(data).hexdigest()})
