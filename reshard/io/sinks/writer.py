"""Atomic rank files and `reshard.json` in a local directory: temp file, fsync, rename; nothing partial
under a final name. The directory sink of the one write path, `reshard.io.sinks.write.write_shards`."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from reshard.format.checkpoint import Source
from reshard.format.rank_file import rank_file_name
from reshard.io.hashing import file_sha256
from reshard.io.outfs import (
    check_space,
    fsync_dir,
    made_dir,
    output_errors,
    remove_stale_temps,
    temp_path,
    write_json_atomic,
)
from reshard.io.progress import Progress
from reshard.io.rank_stream import RankStream
from reshard.io.sinks.outfile import Buffers, OutFile
from reshard.io.source.remote_dir import copy_meta_files
from reshard.plan.types import Plan, RankPlan

MANIFEST_NAME = "reshard.json"
PARTIAL_NAME = ".reshard-partial.json"  # rank files published so far by an unfinished write of one plan
RETRY = "run the same command again (rank files already written are kept)"


WRITERS = 8  # rank files written at once, at most (and at most one per core)


class _Stopped(Exception):
    """Another file of the same write failed, or the write was interrupted: stop this one."""


def _write_data(stream: RankStream, out: OutFile, on_bytes: Callable[[int], None], stop: threading.Event) -> None:
    """Every byte of the rank file into `out`, in file order."""
    while out.size < stream.size:
        if stop.is_set():
            raise _Stopped
        view = out.space()[: stream.size - out.size]
        stream.read_into(out.size, view, check=False)  # checked once, below: nothing is published before
        out.filled(len(view))
        on_bytes(len(view))
    stream.check_unchanged()


def _start(plan: RankPlan, path: Path, buffers: Buffers, on_bytes: Callable[[int], None], stop: threading.Event,
           *, retry: str) -> tuple[Path, OutFile]:
    """Write a rank file's bytes to a temp file beside `path`, hashed as they go out."""
    tmp = temp_path(path)
    with output_errors(path, retry=retry):
        out = OutFile(tmp, buffers)
    try:
        with output_errors(path, retry=retry), RankStream(plan) as stream:
            _write_data(stream, out, on_bytes, stop)
            out.close()
    except BaseException:
        out.abort()
        tmp.unlink(missing_ok=True)
        raise
    return tmp, out


def _finish(tmp: Path, out: OutFile, path: Path, on_published: Callable[[str], None], stop: threading.Event,
            *, retry: str) -> str:
    """fsync the written temp file and publish it under its final name (unless the write stopped meanwhile)."""
    fd = out.fd
    try:
        if stop.is_set():
            raise _Stopped
        with output_errors(path, retry=retry):
            os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    digest = out.sha.hexdigest()
    on_published(digest)
    return digest


Job = tuple[RankPlan, Path, Callable[[str], None]]  # a file to write, and what to call with its sha256 once published


def write_files(jobs: list[Job], *, on_bytes: Callable[[int], None] | None = None, retry: str = RETRY,
                writers: int | None = None) -> list[str]:
    """Write each job's file atomically (temp, fsync, rename; its directory's fsync is the caller's),
    `writers` at once (default: one per core, at most `WRITERS`): the sha256 of each is one core's
    work. Returns their sha256s, in order. `on_bytes` is called from the writing threads, one call at
    a time. An OSError of the output side is raised as its `OutputError`, whose fix ends with `retry`.
    After the first failure (or an interrupt) the other files stop and none is published; files
    already published stay."""
    lock, stop, buffers = threading.Lock(), threading.Event(), Buffers()

    def counted(n: int) -> None:
        if on_bytes is not None:
            with lock:
                on_bytes(n)

    def finish(tmp: Path, out: OutFile, path: Path, on_published: Callable[[str], None]) -> str:
        try:
            return _finish(tmp, out, path, on_published, stop, retry=retry)
        except BaseException:
            stop.set()
            raise

    def one(job: Job) -> Future[str]:
        plan, path, on_published = job
        if stop.is_set():
            raise _Stopped
        tmp, out = _start(plan, path, buffers, counted, stop, retry=retry)
        return finishing.submit(finish, tmp, out, path, on_published)

    if writers is None:
        writers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, WRITERS)
    # the writers are waited for first: one that completes its file after an interrupt still hands it
    # to a finisher, which removes it instead of publishing it
    with ThreadPoolExecutor(2, thread_name_prefix="reshard-fsync") as finishing, \
            ThreadPoolExecutor(max(1, min(len(jobs), writers)), thread_name_prefix="reshard-write") as writing:
        writes: list[Future[Future[str]]] = []
        try:
            writes.extend(writing.submit(one, job) for job in jobs)
            for w in as_completed(writes):
                if w.exception() is not None:
                    stop.set()
        except BaseException:  # an interrupt: the writers stop at their next piece, and are waited for
            stop.set()
            raise
    finishes = [w.result() for w in writes if w.exception() is None]
    errors = [e for e in (f.exception() for f in [*writes, *finishes]) if e is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
    return [f.result() for f in finishes]


def write_to_dir(
    ckpt: Source, plan: Plan, out_dir: str | os.PathLike[str], *, progress: bool | None = None,
    on_bytes: Callable[[int], None] | None = None, writers: int | None = None,
) -> dict[str, Any]:
    """Write every rank in `plan` to `out_dir`, then `reshard.json` (merged with an earlier run of the same plan).

    Resumable: rank files an interrupted run of the same plan published (listed in `.reshard-partial.json`
    or `reshard.json`, same size and sha256 when read back) are kept, the others written; reshard.json
    is written only once every rank is in place. Free space is checked before the first byte, and an
    OSError of the output side is raised as its `OutputError`. Returns the record written to
    reshard.json plus `kept` and `written` (rank numbers).

    Rank files are written `writers` at once (default: one per core; see `write_files`), each hashed
    as it goes out; fsync and rename overlap the next rank. `on_bytes` is called from the writing
    threads, one call at a time. A write that fails (or is interrupted) before publishing anything
    removes the directories it made.
    """
    with made_dir(out_dir) as out:
        return _write_into(out, ckpt, plan, progress=progress, on_bytes=on_bytes, writers=writers)


def _write_into(out: Path, ckpt: Source, plan: Plan, *, progress: bool | None,
                on_bytes: Callable[[int], None] | None, writers: int | None) -> dict[str, Any]:
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

    write_files([(rp, out / rank_file_name(rp.rank, rp.world), published.adder(rank_file_name(rp.rank, rp.world), rp))
                 for rp in todo], on_bytes=done, writers=writers)
    bar.close()
    with output_errors(out, retry=RETRY):
        fsync_dir(out)
        copy_meta_files(ckpt.root, out)  # config.json, generation config, tokenizer: what the source has
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


def pulled_record(files: dict[str, Any], *, plan: dict[str, Any], source_url: str,
                  config: dict[str, Any] | None) -> dict[str, Any]:
    """What `reshard.json` says of rank files pulled from the service (`reshard write URL`): the service's
    plan (`plan_to_json`'s head: tp, layout, digest, manifest source) in place of a local one."""
    return {"files": files, "format": "reshard/1", "tp": plan["tp"],
            **({"layout": plan["layout"], "world": plan["world"]} if plan.get("layout") else {}),
            "plan": plan["plan"], "source": {"url": source_url}, "manifest": {"source": plan["manifest_source"]},
            "config": config}


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
