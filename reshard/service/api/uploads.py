"""Checkpoint file uploads: streamed to a hidden temp file, validated, published with one rename.

Nothing is published unless the whole body arrived within the size limit and the file validates
(a safetensors header that matches the file's size, or a JSON config / index). The temp file lives in
the checkpoint's own directory (same file system, so the rename is atomic) under a name no reader
looks at (`.upload-PID-START-*.part`, naming the worker process that writes it), and is removed on every
failure, client disconnects included. A worker that is killed cannot remove its own: the next worker to
start (the supervisor's replacement, or a restart) removes every upload temp file whose owner is gone
(`remove_dead_uploads`), and the checkpoint directory the upload created if nothing else is in it.

A new name's directory is created by the first upload to it and removed again by a failed one when
it is empty; an upload whose directory is removed that way before its temp file exists creates it
again (the temp file keeps it from being removed after that).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio.to_thread

from reshard.errors import CheckpointError, HeaderError, NotFoundError
from reshard.format.checkpoint import INDEX_NAME, JSON_MAX_BYTES, parse_json, read_header
from reshard.io.outfs import check_space, fsync_dir, output_errors
from reshard.io.owners import TAG, owner_gone, owner_tag
from reshard.service.catalog import Catalog, allowed_upload, valid_name
from reshard.service.http_errors import Conflict, PayloadTooLarge
from reshard.service.process.leftovers import remove_dead

log = logging.getLogger("reshard.service")
_FLUSH = 4 << 20
_RETRY = "upload the file again"
_TEMP = re.compile(rf"^\.upload-(?:({TAG})-)?[0-9a-f]{{32}}\.part$")  # without an owner: an older version's
_OWNERLESS_AGE = 3600.0  # seconds since its last write after which an ownerless upload temp file is removed
_OPEN_TRIES = 8


def remove_dead_uploads(root: Path) -> int:
    """Remove the upload temp files under `root`'s checkpoint directories whose worker is gone (and a
    directory left empty by that); how many files. Call when a worker starts."""
    removed = 0
    try:
        dirs = [d for d in root.iterdir() if valid_name(d.name) and d.is_dir() and not d.is_symlink()]
    except OSError:
        return 0
    for d in dirs:
        n = remove_dead(d, _dead_temp)
        removed += n
        if n:
            with contextlib.suppress(OSError):
                d.rmdir()  # only if nothing else is in it: the upload created it
    if removed:
        log.warning("removed %d upload temp files that killed workers left under %s", removed, root)
    return removed


def _dead_temp(path: Path) -> bool:
    m = _TEMP.match(path.name)
    return m is not None and owner_gone(path, m.group(1), ownerless_age=_OWNERLESS_AGE)


def _open_temp(catalog: Catalog, name: str) -> tuple[Path, Path, int]:
    """(checkpoint directory, temp file, its fd), the directory created when new. A failed upload to the
    same new name may remove the directory between the two steps (it was empty): then again."""
    for attempt in range(_OPEN_TRIES):
        try:
            directory = catalog.directory(name, create=True)
            tmp = directory / f".upload-{owner_tag()}-{uuid.uuid4().hex}.part"
            return directory, tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except (FileNotFoundError, NotFoundError):
            if attempt == _OPEN_TRIES - 1 or os.path.lexists(catalog.root / name):
                raise
    raise AssertionError("unreachable")


def _validate(path: Path, filename: str) -> dict[str, Any]:
    """Check the received file; raise HeaderError / CheckpointError (422) when it is not what it claims."""
    if filename.endswith(".safetensors"):
        try:
            info, tensors = read_header(path)
        except HeaderError as e:  # name the upload, not the temp file
            raise HeaderError(str(e).replace(str(path), f"{path.parent.name}/{filename} (upload)")) from None
        return {"tensors": len(tensors), "header_bytes": info.header_len}
    obj = parse_json(path.read_bytes(), filename)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{filename}: must be a JSON object, got {type(obj).__name__}")
    if filename == INDEX_NAME:
        wm = obj.get("weight_map")
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise CheckpointError(f"{filename}: must have a 'weight_map' of tensor name -> file name")
        bad = [v for v in wm.values() if Path(v).name != v or not v.endswith(".safetensors")]
        if bad:
            raise CheckpointError(f"{filename}: weight_map names {bad[0]!r}, not a plain *.safetensors file name")
    return {}


async def receive_upload(
    catalog: Catalog, name: str, filename: str, body: AsyncIterator[bytes], *,
    content_length: int | None, max_bytes: int,
) -> dict[str, Any]:
    """Store `body` as `filename` of checkpoint `name` (created when new); return what was published.

    Free space is checked first when the length is known; an OSError of the server's disk (full,
    read-only...) is raised as its `reshard.errors.OutputError` (answered 507 when out of space), and
    nothing of the upload is left behind.
    """
    with output_errors(catalog.root / name / filename, retry=_RETRY):
        return await _receive(catalog, name, filename, body, content_length=content_length, max_bytes=max_bytes)


async def _receive(
    catalog: Catalog, name: str, filename: str, body: AsyncIterator[bytes], *,
    content_length: int | None, max_bytes: int,
) -> dict[str, Any]:
    allowed_upload(filename)
    if not filename.endswith(".safetensors"):  # a JSON file is parsed whole: its own, smaller limit
        max_bytes = min(max_bytes, JSON_MAX_BYTES)
    if content_length is not None and content_length > max_bytes:
        raise PayloadTooLarge(f"{filename}: {content_length} bytes exceeds the {max_bytes}-byte upload limit")
    local = isinstance(catalog.root, Path)  # a root in a store refuses uploads in `directory`
    new_dir = not os.path.lexists(catalog.root / name) if valid_name(name) and local else False
    if content_length is not None and local:
        check_space(catalog.root / name, content_length, fix=f"free some space on the server, then {_RETRY}")
    directory, tmp, fd = _open_temp(catalog, name)
    final = directory / filename
    sha, size, pending = hashlib.sha256(), 0, bytearray()
    published = False
    try:
        if final.is_dir() and not final.is_symlink():
            raise Conflict(f"{name}/{filename} is a directory; refusing to replace it")
        async for piece in body:
            size += len(piece)
            if size > max_bytes:
                raise PayloadTooLarge(f"{filename}: more than the {max_bytes}-byte upload limit")
            pending += piece
            if len(pending) >= _FLUSH:
                data, pending = pending, bytearray()
                await anyio.to_thread.run_sync(_write, fd, data, sha)
        if pending:
            await anyio.to_thread.run_sync(_write, fd, pending, sha)
        if content_length is not None and size != content_length:
            raise CheckpointError(f"{filename}: received {size} bytes but Content-Length said {content_length}")
        await anyio.to_thread.run_sync(os.fsync, fd)
        os.close(fd)
        fd = -1
        details = await anyio.to_thread.run_sync(_validate, tmp, filename)
        existed = os.path.lexists(final)
        os.replace(tmp, final)
        published = True
        await anyio.to_thread.run_sync(fsync_dir, directory)
    finally:
        if fd >= 0:
            os.close(fd)
        if not published:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if new_dir:
                with contextlib.suppress(OSError):
                    directory.rmdir()  # only if still empty
    return {"name": name, "file": filename, "size": size, "sha256": sha.hexdigest(), "replaced": existed, **details}


def _write(fd: int, data: bytearray, sha: Any) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    sha.update(data)
