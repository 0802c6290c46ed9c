"""Atomic rank files and `reshard.json`: temp file, fsync, rename; nothing partial under a final name."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from reshard.errors import SourceChangedError
from reshard.format import CONFIG_NAME, Source
from reshard.plan import Plan, RankPlan, rank_file_name
from reshard.progress import Progress
from reshard.stream import CHUNK, RankStream

MANIFEST_NAME = "reshard.json"
TMP_PREFIX = ".tmp-"


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[IO[bytes]]:
    """Write `path` atomically: a temp file beside it, fsync, rename, fsync the directory."""
    path = Path(path)
    tmp = _tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def _tmp_path(path: Path) -> Path:
    """The temp file beside `path` that this process writes before renaming (see `remove_stale_temps`)."""
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")


def copy_atomic(src: Path, dst: Path) -> None:
    """Copy the file `src` to `dst` atomically."""
    with atomic_file(dst) as f, open(src, "rb") as g:
        shutil.copyfileobj(g, f)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory: Path) -> None:
    """Remove temp files left by writers that no longer run (killed mid-write)."""
    for p in Path(directory).glob(f"{TMP_PREFIX}*"):
        pid = p.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_json_atomic(path: Path, obj: Any) -> None:
    with atomic_file(path) as f:
        f.write((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


COPY_MIN = 1 << 20  # contiguous source ranges at least this long are copied in the kernel


def _copy_range(src: int, dst: int, n: int, src_off: int, dst_off: int) -> None:
    """Copy n bytes between files in the kernel (copy_file_range), falling back to read + write."""
    while n:
        try:
            k = os.copy_file_range(src, dst, n, src_off, dst_off)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            k = _pwrite_all(dst, os.pread(src, min(n, CHUNK), src_off), dst_off)
        if k == 0:
            raise SourceChangedError(f"source ended before offset {src_off + n}; re-plan")
        n, src_off, dst_off = n - k, src_off + k, dst_off + k


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> int:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)
    return done


def _write_data(stream: RankStream, fd: int, on_bytes: Callable[[int], None]) -> None:
    """Every byte of the rank file into fd: long contiguous source ranges by kernel copy, the rest
    (header, strided runs, padding) through one chunk buffer."""
    buf = memoryview(bytearray(CHUNK))
    fill, buf_pos = 0, 0

    def flush() -> None:
        nonlocal fill
        if fill:
            _pwrite_all(fd, buf[:fill], buf_pos)
            on_bytes(fill)
            fill = 0

    for pos, n, src in stream.spans():
        if src is not None and n >= COPY_MIN:
            flush()
            _copy_range(src[0], fd, n, src[1], pos)
            on_bytes(n)
            continue
        while n:
            if fill == 0:
                buf_pos = pos
            take = min(n, CHUNK - fill)
            stream.read_into(pos, buf[fill : fill + take])
            fill, pos, n = fill + take, pos + take, n - take
            if fill == CHUNK:
                flush()
    flush()
    stream.check_unchanged()


class _Hasher(threading.Thread):
    """Hashes a file that is being written, following the writer: `advance(n)` says n more bytes
    (in order) are in place. The file is mapped once, so hashing copies nothing."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__(daemon=True)
        os.ftruncate(fd, size)
        self.size, self.avail = size, 0
        self.map = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
        self.sha = hashlib.sha256()
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.start()

    def advance(self, n: int) -> None:
        with self.cond:
            self.avail += n
            self.cond.notify()

    def run(self) -> None:
        done = released = 0
        try:
            view = memoryview(self.map) if self.map is not None else memoryview(b"")
            while done < self.size:
                with self.cond:
                    while self.avail <= done:
                        self.cond.wait()
                    upto = min(self.avail, done + (8 << 20))
                self.sha.update(view[done:upto])
                done = upto
                # drop hashed pages from this process (they stay in the page cache): RSS stays flat
                edge = done - done % mmap.PAGESIZE
                if edge > released:
                    self.map.madvise(mmap.MADV_DONTNEED, released, edge - released)
                    released = edge
            view.release()
        except BaseException as e:  # reported by digest()
            self.error = e

    def digest(self) -> str:
        self.join()
        if self.map is not None:
            self.map.close()
        if self.error is not None:
            raise self.error
        return self.sha.hexdigest()


def _finish(tmp: Path, fd: int, hasher: _Hasher, path: Path) -> str:
    """Wait for the hash of the written temp file, fsync it and publish it under its final name."""
    try:
        digest = hasher.digest()
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    return digest


def _start(plan: RankPlan, path: Path, on_bytes: Callable[[int], None]) -> tuple[Path, int, _Hasher]:
    """Write a rank file's bytes to a temp file beside `path`, hashed as they land."""
    tmp = _tmp_path(path)
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
    hasher = None
    try:
        hasher = _Hasher(fd, plan.size)

        def done(n: int) -> None:
            hasher.advance(n)
            on_bytes(n)

        with RankStream(plan) as stream:
            _write_data(stream, fd, done)
    except BaseException:
        if hasher is not None:
            hasher.advance(plan.size)  # let it finish and release the mapping
            hasher.digest()
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return tmp, fd, hasher


def write_rank_file(plan: RankPlan, path: Path, *, on_bytes: Callable[[int], None] | None = None) -> str:
    """Write one rank file to `path` atomically (temp, fsync, rename); return its sha256."""
    tmp, fd, hasher = _start(plan, path, on_bytes or (lambda n: None))
    digest = _finish(tmp, fd, hasher, path)
    fsync_dir(path.parent)
    return digest


def write_shards(
    ckpt: Source, plan: Plan, out_dir: str | os.PathLike[str], *, progress: bool | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write every rank in `plan` to `out_dir`, then `reshard.json` (merged with an earlier run of the same plan).

    Each file is hashed by a thread that follows its writer; fsync and rename overlap the next rank.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    bar = Progress(sum(r.size for r in plan.ranks), "write", enabled=progress)
    record = _load_record(out / MANIFEST_NAME, plan.digest)
    if not record["files"] and (out / MANIFEST_NAME).exists():
        # the record of another plan would vouch for rank files this run is about to replace: remove it
        # first, so that whenever reshard.json exists every file it lists has the listed sha256
        (out / MANIFEST_NAME).unlink()
        fsync_dir(out)

    def done(n: int) -> None:
        bar.update(n)
        if on_bytes is not None:
            on_bytes(n)

    pending: list[tuple[str, RankPlan, Future[str]]] = []
    with ThreadPoolExecutor(2) as pool:
        try:
            for rp in plan.ranks:
                name = rank_file_name(rp.rank, rp.tp)
                tmp, fd, hasher = _start(rp, out / name, done)
                pending.append((name, rp, pool.submit(_finish, tmp, fd, hasher, out / name)))
        finally:
            results = [(name, rp, fut.exception() or fut.result()) for name, rp, fut in pending]
    for name, rp, digest in results:
        if isinstance(digest, BaseException):
            raise digest
        record["files"][name] = {"rank": rp.rank, "size": rp.size, "sha256": digest}
    bar.close()
    fsync_dir(out)
    if ckpt.config is not None:
        from reshard.sources import copy_beside  # the source may be in a store

        copy_beside(ckpt.root, CONFIG_NAME, out / CONFIG_NAME)
    write_json_atomic(out / MANIFEST_NAME, complete_record(record, ckpt, plan))
    return record


def complete_record(record: dict[str, Any], ckpt: Source, plan: Plan) -> dict[str, Any]:
    """`record` (its `files` filled in) with what `reshard.json` says about the plan and source."""
    record.update(
        format="reshard/1",
        tp=plan.tp,
        plan=plan.digest,
        source={"path": str(ckpt.root), **ckpt.identity()},
        manifest={"source": plan.manifest.source, **plan.manifest.to_dict()},
        config=ckpt.config,
    )
    return record


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
