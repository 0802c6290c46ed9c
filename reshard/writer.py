"""Atomic rank files and `reshard.json`: temp file, fsync, rename; nothing partial under a final name."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

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
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")
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


def write_rank_file(plan: RankPlan, path: Path, *, on_bytes: Callable[[int], None] | None = None) -> str:
    """Stream one rank file to `path` atomically; return its sha256.

    Reading overlaps writing and hashing: while a thread writes and hashes one chunk, the next is read.
    """
    sha = hashlib.sha256()
    bufs = [bytearray(min(CHUNK, max(plan.size, 1))) for _ in range(2)]
    with RankStream(plan) as stream, atomic_file(path) as f, ThreadPoolExecutor(1) as pool:
        pending: Future[None] | None = None

        def sink(view: memoryview) -> None:
            f.write(view)
            sha.update(view)

        pos, i = 0, 0
        while pos < plan.size:
            n = min(CHUNK, plan.size - pos)
            view = memoryview(bufs[i % 2])[:n]
            stream.read_into(pos, view)
            if pending is not None:
                pending.result()
            pending = pool.submit(sink, view)
            if on_bytes:
                on_bytes(n)
            pos += n
            i += 1
        if pending is not None:
            pending.result()
    return sha.hexdigest()


def write_shards(
    ckpt: Source, plan: Plan, out_dir: str | os.PathLike[str], *, progress: bool | None = None
) -> dict[str, Any]:
    """Write every rank in `plan` to `out_dir`, then `reshard.json` (merged with an earlier run of the same plan)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    bar = Progress(sum(r.size for r in plan.ranks), "write", enabled=progress)
    record = _load_record(out / MANIFEST_NAME, plan.digest)
    for rp in plan.ranks:
        name = rank_file_name(rp.rank, rp.tp)
        digest = write_rank_file(rp, out / name, on_bytes=bar.update)
        record["files"][name] = {"rank": rp.rank, "size": rp.size, "sha256": digest}
    bar.close()
    if ckpt.config is not None:
        src = ckpt.root / CONFIG_NAME
        with atomic_file(out / CONFIG_NAME) as f, open(src, "rb") as g:
            shutil.copyfileobj(g, f)
    record.update(
        format="reshard/1",
        tp=plan.tp,
        plan=plan.digest,
        source={"path": str(ckpt.root), **ckpt.identity()},
        manifest={"source": plan.manifest.source, **plan.manifest.to_dict()},
        config=ckpt.config,
    )
    write_json_atomic(out / MANIFEST_NAME, record)
    return record


def _load_record(path: Path, digest: str) -> dict[str, Any]:
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict) and old.get("plan") == digest and isinstance(old.get("files"), dict):
            return old
    except (OSError, ValueError):
        pass
    return {"files": {}}
