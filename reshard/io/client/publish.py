"""What a client of the service publishes as files: a rank shard (`reshard pull`), the small files (`--meta`).

    pull_shard(client, rank, tp, "rank-00001-of-00004.safetensors")   # atomic, resumable, checked
    pull_meta(client, "model_dir/")                                   # config.json, tokenizer, ...

Nothing the server says decides where a byte is written, or how many:
- the listing of small files is checked whole before anything is fetched: every name one of
  `reshard.format.meta_files.META_NAMES` (never a path), sizes and digests well formed
  (`check_listing`); each body is taken up to its listed size (`ShardClient.meta_pieces`), hashed,
  and published only when size and sha256 match;
- every file is written to a temp file beside its destination that was created for it (`O_EXCL |
  O_NOFOLLOW`, `reshard.io.outfs`): a symlink or file planted at a temp name is never written through.
  The small files' temps have random names; a shard's partial file keeps its fixed name
  `.NAME.part` (with `.NAME.part.json`, naming the shard version it holds) so that the next pull
  resumes it, and it is resumed only if it is a regular file of this user with no other link;
- a shard is parsed before it is renamed into place: its header must describe exactly the bytes
  received (no tensor past the end), and its self-description must name the rank and layout asked
  for (the sha256 is checked as well, `ShardClient.pieces`); anything else is an `IntegrityError`,
  the partial file removed, nothing published.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reshard.errors import CheckpointError, HeaderError, IntegrityError, OutputPathError, PlanError
from reshard.format.checkpoint import MAX_HEADER_BYTES, header_from
from reshard.format.rank_file import decode_metadata, rank_file_name
from reshard.io.client.wire import as_world, layout_params
from reshard.io.hashing import file_sha256
from reshard.io.outfs import (
    check_space,
    create_exclusive,
    fsync_dir,
    made_dir,
    open_own,
    output_errors,
    random_temp,
)
from reshard.io.pread import pread_full
from reshard.io.progress import Progress
from reshard.layout.mesh import Layout
from reshard.layout.placement import describe_layout

if TYPE_CHECKING:
    from reshard.io.client.shard_client import ShardClient, ShardHead

_STATE_BYTES = 64 << 10  # a `.part.json` larger than this is no state of ours


def pull_shard(client: ShardClient, rank: int, tp: int | Layout, dest: str | os.PathLike[str], *,
               progress: bool | None = None, resume: bool = True) -> dict[str, Any]:
    """Download rank `rank` of `tp` to `dest` atomically (temp file + fsync + rename). A partial file left
    by an earlier try of the same shard (same ETag) is resumed; a `dest` that is already this shard (its
    size, the server's sha256, its header) is verified and kept, nothing written (a full or read-only disk is
    no obstacle then). Returns path, size, sha256, etag, resumed_from and kept.

    A pull that fails before any byte lands leaves nothing: no `.part`, no `.part.json`, no directory it
    made; one that fails later keeps its partial file to resume from (unless the bytes are wrong:
    `IntegrityError`)."""
    dest = Path(dest)
    part, state = dest.with_name(f".{dest.name}.part"), dest.with_name(f".{dest.name}.part.json")
    head = client.head(rank, tp)
    with made_dir(dest.parent, for_file=dest):
        if dest.is_dir():
            raise OutputPathError(f"{dest}: is a directory; give the file to write, e.g. {dest / rank_file_name(rank, as_world(tp))}")
        digest = _in_place(client, rank, tp, dest, head)
        if digest is not None:
            _remove(part, state)  # a leftover of an earlier try: the shard is here already
            return {"path": str(dest), "rank": rank, "tp": tp, "size": head.size, "sha256": digest,
                    "etag": head.etag, "resumed_from": head.size, "kept": True}
        start, digest = _download(client, rank, tp, dest, part, state, head, progress=progress, resume=resume)
    return {"path": str(dest), "rank": rank, "tp": tp, "size": head.size, "sha256": digest,
            "etag": head.etag, "resumed_from": start, "kept": False}


def check_shard(fd: int, size: int, rank: int, tp: int | Layout, what: str) -> None:
    """`IntegrityError` unless the file `fd` (`size` bytes) is a rank file whose header describes exactly its
    bytes and names rank `rank` of `tp` (`Layout`, or tp alone)."""
    layout = tp if isinstance(tp, Layout) else Layout(tp=tp)
    head = bytearray(8)
    try:
        if size < 8 or pread_full(fd, memoryview(head), 0) < 8:
            raise HeaderError(f"{what}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise HeaderError(f"{what}: header length {n} runs past the end of the {size}-byte file")
        head += bytes(n)
        pread_full(fd, memoryview(head)[8:], 8)
        info, _ = header_from(what, bytes(head), size=size)  # every tensor inside the file, the file covered
        meta = decode_metadata(info.metadata, what)
        got = describe_layout(meta, what)
    except (HeaderError, CheckpointError, PlanError) as e:
        raise IntegrityError(f"{e}; the server sent no valid rank file, nothing was published") from None
    if (meta.rank, got) != (rank, layout):
        raise IntegrityError(f"{what}: the server sent the shard of rank {meta.rank} of {got.describe()} when asked "
                             f"for rank {rank} of {layout.describe()}; nothing was published")


def _in_place(client: ShardClient, rank: int, tp: int | Layout, dest: Path, head: ShardHead) -> str | None:
    """The sha256 of `dest` if it already is the shard `head` describes (size, the server's sha256, its
    header), else None."""
    fd = open_own(dest)
    if fd is None:
        return None
    try:
        size = os.fstat(fd).st_size
        if size != head.size:
            return None
        check_shard(fd, size, rank, tp, str(dest))
        digest = file_sha256(dest)
    except (OSError, IntegrityError):  # unreadable or not this shard: downloaded again
        return None
    finally:
        os.close(fd)
    want = head.sha256
    if want is None:
        d = client.digest(rank, tp)
        want = d["sha256"] if d["etag"] == head.etag else None  # changed meanwhile: download the new one
    return digest if digest == want else None


def _download(client: ShardClient, rank: int, tp: int | Layout, dest: Path, part: Path, state: Path, head: ShardHead,
              *, progress: bool | None, resume: bool) -> tuple[int, str]:
    """Into `part` (resumed where `state` names this shard's ETag), verified, checked, renamed to `dest`;
    (the offset it resumed from, sha256)."""
    retry = f"run the same pull again (it resumes from {part.name})"
    version = {"url": client.shard_url(rank), **layout_params(tp), "etag": head.etag}
    sha, start = hashlib.sha256(), 0
    bar = Progress(head.size, f"rank {rank}/{as_world(tp)}", enabled=progress)
    fd = _resumable(part, state, version) if resume else None
    try:
        with output_errors(dest, retry=retry):  # out of space etc.: the partial file stays, to resume
            if fd is not None:
                start = min(os.fstat(fd).st_size, head.size)
                with open(os.dup(fd), "rb") as f:  # the bytes already here count towards the digest
                    left = start
                    while left and (block := f.read(min(8 << 20, left))):
                        sha.update(block)
                        left -= len(block)
            check_space(dest.parent, head.size - start, fix=f"free some space there or pull elsewhere, then {retry}")
            if fd is None:
                _remove(part, state)  # whatever is at these names (a symlink included) goes, not written through
                fd = create_exclusive(part, flags=os.O_RDWR)
                _write_state(state, version)
            bar.update(start)
            with open(fd, "r+b", buffering=0, closefd=True) as f:
                fd = None
                f.truncate(start)
                f.seek(start)
                for _pos, _size, piece in client.pieces(rank, tp, start=start, etag=head.etag, size=head.size, sha=sha):
                    view = memoryview(piece)
                    while view:
                        view = view[f.write(view):]
                    bar.update(len(piece))
                os.fsync(f.fileno())
                check_shard(f.fileno(), head.size, rank, tp, f"{client.shard_url(rank)} ({part})")
            os.replace(part, dest)
    except BaseException as e:
        # wrong bytes, or nothing received yet: nothing worth resuming from
        if isinstance(e, IntegrityError) or not _has_bytes(part):
            _remove(part, state)
        raise
    finally:
        if fd is not None:
            os.close(fd)
        bar.close()
    with contextlib.suppress(FileNotFoundError):
        state.unlink()
    fsync_dir(dest.parent)
    return start, sha.hexdigest()


def _resumable(part: Path, state: Path, version: dict[str, Any]) -> int | None:
    """`part` opened to resume (read-write), if `state` says it holds `version` and both are regular files
    of this user with no other link; else None."""
    sfd = open_own(state)
    if sfd is None:
        return None
    try:
        with open(sfd, "rb") as f:
            data = f.read(_STATE_BYTES + 1)
        recorded = json.loads(data) if len(data) <= _STATE_BYTES else None
    except (OSError, ValueError):
        return None
    return open_own(part, os.O_RDWR) if recorded == version else None


def _write_state(state: Path, version: dict[str, Any]) -> None:
    """`state` (which shard version the partial file holds), written to a temp file and renamed over
    whatever is at the name (a rename replaces a symlink; it never writes through it)."""
    tmp, fd = random_temp(state, suffix=".tmp")
    try:
        with open(fd, "wb") as f:
            f.write(json.dumps(version).encode())
        os.replace(tmp, state)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def pull_meta(client: ShardClient, dest: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Copy the checkpoint's small files (config.json, tokenizer, generation config) into the directory
    `dest`: the listing checked first (`ShardClient.meta_listing`), each file taken up to its listed size,
    verified against its sha256 and published with a rename; a regular file already there with the same
    digest is kept. Returns the server's list (name, size, sha256)."""
    dest = Path(dest)
    files = client.meta_listing()
    with made_dir(dest, for_file=dest / "config.json"), output_errors(dest, retry="run the same pull again"):
        check_space(dest, sum(f["size"] for f in files), fix="free some space there or pull elsewhere")
        for f in files:
            path = dest / f["name"]
            if _same(path, f):
                continue
            tmp, fd = random_temp(path)
            try:
                with open(fd, "wb") as out:
                    for _pos, _size, piece in client.meta_pieces(f):
                        out.write(piece)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        fsync_dir(dest)
    return files


def _same(path: Path, entry: dict[str, Any]) -> bool:
    """Whether `path` is a regular file (not a link) with the listed size and sha256."""
    fd = open_own(path)
    if fd is None:
        return False
    try:
        if os.fstat(fd).st_size != entry["size"]:
            return False
    finally:
        os.close(fd)
    return file_sha256(path) == entry["sha256"]


def _remove(*paths: Path) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            p.unlink()


def _has_bytes(path: Path) -> bool:
    try:
        return os.lstat(path).st_size > 0
    except OSError:
        return False


__all__ = ["check_shard", "pull_meta", "pull_shard"]
