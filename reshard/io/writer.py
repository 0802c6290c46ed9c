"""Atomic rank files and `reshard.json`: temp file, fsync, rename; nothing partial under a final name."""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from reshard.errors import SourceChangedError
from reshard.format.checkpoint import CONFIG_NAME, Source
from reshard.io.hashing import file_sha256
from reshard.io.outfs import (
    check_space,
    fsync_dir,
    made_dir,
    output_errors,
    remove_stale_temps,
    start_writeback,
    temp_path,
    write_json_atomic,
)
from reshard.io.outhash import Buffers, OutHash
from reshard.io.progress import Progress
from reshard.io.remote_dir import copy_beside
from reshard.io.stream import CHUNK, RankStream
from reshard.plan.types import Plan, RankPlan, rank_file_name

MANIFEST_NAME = "reshard.json"
PARTIAL_NAME = ".reshard-partial.json"  # rank files published so far by an unfinished write of one plan
RETRY = "run the same command again (rank files already written are kept)"


COPY_MIN = 1 << 20  # contiguous source ranges at least this long are copied in the kernel


def _copy_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> None:
    """Copy n bytes between files in the kernel (copy_file_range), falling back to read + write."""
    while n:
        try:
            k = os.copy_file_range(src, dst, n, src_off, dst_off)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            k = pwrite_all(dst, os.pread(src, min(n, CHUNK), src_off), dst_off)
        if k == 0:
            raise SourceChangedError(f"source ended before offset {src_off + n}; re-plan")
        n, src_off, dst_off = n - k, src_off + k, dst_off + k


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> int:
    """Write all of `data` at `offset` of `fd` (pwrite may write less); the bytes written."""
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _write_data(stream: RankStream, fd: int, hasher: OutHash, on_bytes: Callable[[int], None]) -> None:
    """Every byte of the rank file into fd: long contiguous source ranges by kernel copy, the rest
    (header, strided runs, padding) through pooled chunk buffers; each range handed to the hasher as
    it goes out, and its write-back to the disk started at once (the final fsync then waits for less)."""
    for pos, n, src in stream.runs(chunk_size=CHUNK, direct_min=COPY_MIN):
        if src is not None:
            _copy_range(src[0], fd, n, src[1], pos)
            hasher.copied(src[0], src[1], n)
        else:
            buf = hasher.take()
            stream.read_into(pos, buf[:n])
            pwrite_all(fd, buf[:n], pos)
            hasher.written(buf, n)
        start_writeback(fd, pos, n)
        on_bytes(n)
    stream.check_unchanged()


def _finish(tmp: Path, fd: int, hasher: OutHash, path: Path, on_published: Callable[[str], None], *,
            retry: str = RETRY) -> str:
    """Wait for the hash of the written temp file, fsync it and publish it under its final name."""
    try:
        with output_errors(path, retry=retry):
            digest = hasher.digest()
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    on_published(digest)
    return digest


def _start(plan: RankPlan, path: Path, on_bytes: Callable[[int], None], pool: Buffers, *,
           retry: str = RETRY) -> tuple[Path, int, OutHash]:
    """Write a rank file's bytes to a temp file beside `path`, hashed as they go out."""
    tmp = temp_path(path)
    with output_errors(path, retry=retry):
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
    hasher = None
    try:
        hasher = OutHash(pool)
        with output_errors(path, retry=retry), RankStream(plan) as stream:
            _write_data(stream, fd, hasher, on_bytes)
    except BaseException:
        if hasher is not None:
            hasher.cancel()
            hasher.join()
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return tmp, fd, hasher


def write_rank_file(plan: RankPlan, path: Path, *, on_bytes: Callable[[int], None] | None = None,
                    retry: str = RETRY) -> str:
    """Write one rank file to `path` atomically (temp, fsync, rename); return its sha256. An OSError of
    the output side is raised as its `OutputError`, whose fix ends with `retry`."""
    tmp, fd, hasher = _start(plan, path, on_bytes or (lambda n: None), Buffers(CHUNK), retry=retry)
    digest = _finish(tmp, fd, hasher, path, lambda d: None, retry=retry)
    fsync_dir(path.parent)
    return digest


def write_shards(
    ckpt: Source, plan: Plan, out_dir: str | os.PathLike[str], *, progress: bool | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write every rank in `plan` to `out_dir`, then `reshard.json` (merged with an earlier run of the same plan).

    Resumable: rank files an interrupted run of the same plan published (listed in `.reshard-partial.json`
    or `reshard.json`, same size and sha256 when read back) are kept, the others written; reshard.json
    is written only once every rank is in place. Free space is checked before the first byte, and an
    OSError of the output side is raised as its `OutputError`. Returns the record written to
    reshard.json plus `kept` and `written` (rank numbers).

    Each file is hashed by a thread that follows its writer; fsync and rename overlap the next rank.
    A write that fails (or is interrupted) before publishing anything removes the directories it made.
    """
    with made_dir(out_dir) as out:
        return _write_into(out, ckpt, plan, progress=progress, on_bytes=on_bytes)


def _write_into(out: Path, ckpt: Source, plan: Plan, *, progress: bool | None,
                on_bytes: Callable[[int], None] | None) -> dict[str, Any]:
    with output_errors(out, retry=RETRY):
        remove_stale_temps(out)
        record = _load_record(out / MANIFEST_NAME, plan.digest)
        published = _Published(out, plan.digest, record["files"])
        kept = [rp for rp in plan.ranks if published.matches(rank_file_name(rp.rank, rp.world), rp.size)]
        todo = [rp for rp in plan.ranks if rp not in kept]
        check_space(out, sum(rp.size for rp in todo) + (64 << 10), fix=f"free some space there or write elsewhere, then {RETRY}")
        if not record["files"] and (out / MANIFEST_NAME).exists():
            # the record of another plan would vouch for rank files this run is about to replace: remove it
            # first, so that whenever reshard.json exists every file it lists has the listed sha256
            (out / MANIFEST_NAME).unlink()
            fsync_dir(out)
    bar = Progress(sum(r.size for r in todo), "write", enabled=progress)

    def done(n: int) -> None:
        bar.update(n)
        if on_bytes is not None:
            on_bytes(n)

    pending: list[Future[str]] = []
    pool = Buffers(CHUNK)  # the chunk buffers of every file of this write
    with ThreadPoolExecutor(2) as finishing:
        try:
            for rp in todo:
                name = rank_file_name(rp.rank, rp.world)
                tmp, fd, hasher = _start(rp, out / name, done, pool)
                pending.append(finishing.submit(_finish, tmp, fd, hasher, out / name, published.adder(name, rp)))
        finally:
            errors = [e for e in (fut.exception() for fut in pending) if e is not None]
    if errors:
        raise errors[0]
    bar.close()
    with output_errors(out, retry=RETRY):
        fsync_dir(out)
        if ckpt.config is not None:
            copy_beside(ckpt.root, CONFIG_NAME, out / CONFIG_NAME)
        record["files"] = published.files
        write_json_atomic(out / MANIFEST_NAME, complete_record(record, ckpt, plan))
        published.complete()
    return {**record, "kept": [rp.rank for rp in kept], "written": [rp.rank for rp in todo]}


def complete_record(record: dict[str, Any], ckpt: Source, plan: Plan) -> dict[str, Any]:
    """`record` (its `files` filled in) with what `reshard.json` says about the plan and source."""
    record.update(
        format="reshard/1",
        tp=plan.tp,
        **({} if plan.layout.tp_only else {"layout": plan.layout.sizes(), "world": plan.world}),
        plan=plan.digest,
        source={"path": str(ckpt.root), **ckpt.identity()},
        manifest={"source": plan.manifest.source, **plan.manifest.to_dict()},
        config=ckpt.config,
    )
    return record


class _Published:
    """The rank files of one plan that are in place: those an earlier run recorded (reshard.json, or
    `.reshard-partial.json` while a set is incomplete) and still match, plus those this run publishes.
    The partial record is rewritten after every publish, so a run killed at any point can be resumed."""

    def __init__(self, out: Path, digest: str, files: dict[str, Any]) -> None:
        self.out, self.digest, self.path = out, digest, out / PARTIAL_NAME
        self.files = dict(files)
        self.files.update(_load_record(self.path, digest)["files"])
        self.lock = threading.Lock()

    def matches(self, name: str, size: int) -> bool:
        """Whether `name` is in place: recorded with this size, and the file has that size and sha256."""
        entry, path = self.files.get(name), self.out / name
        ok = isinstance(entry, dict) and entry.get("size") == size and path.is_file() \
            and path.stat().st_size == size and file_sha256(path) == entry.get("sha256")
        if not ok:
            self.files.pop(name, None)
        return ok

    def adder(self, name: str, rp: RankPlan) -> Callable[[str], None]:
        def add(digest: str) -> None:
            with self.lock, output_errors(self.path, retry=RETRY):
                self.files[name] = {"rank": rp.rank, "size": rp.size, "sha256": digest}
                write_json_atomic(self.path, {"plan": self.digest, "files": self.files})
        return add

    def complete(self) -> None:
        """reshard.json now lists every file: the partial record is no longer needed."""
        self.path.unlink(missing_ok=True)


def _load_record(path: Path, digest: str) -> dict[str, Any]:
    try:
        return record_of_plan(path.read_text(), digest)
    except OSError:
        return {"files": {}}


def record_of_plan(text: str | bytes | None, digest: str) -> dict[str, Any]:
    """An earlier `reshard.json` (its text) if it is of plan `digest`, else an empty record."""
    try:
        old = json.loads(text) if text is not None else None
        if isinstance(old, dict) and old.get("plan") == digest and isinstance(old.get("files"), dict):
            return old
    except ValueError:
        pass
    return {"files": {}}
