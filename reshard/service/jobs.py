"""Background write jobs: rank files of a checkpoint into OUT/NAME/tp-N, their state shared by every worker.

A job is planned when it is submitted (so bad input is a 4xx answer, not a failed job), then written
by a small thread pool of the worker process that accepted it, with the same `write_shards` as
`reshard write`: each file atomic, then `reshard.json`. Its state lives in the SQLite database every
worker opens (`reshard.service.state`), so any worker answers `GET /v1/jobs/{id}`; it is claimed (queued ->
running) in one transaction, so it runs exactly once. Jobs writing the same output directory run one
after another, across workers too (an `flock` per output directory). The newest `max_jobs_kept` are
remembered; progress is saved at most every `PROGRESS_EVERY` seconds, state changes at once.

A server that stops mid-job never half-publishes: rank files appear only complete, under their final
names. When it stops gracefully, the running job is interrupted at its next chunk and queued ones are
cancelled; either way they are reported `failed` ("interrupted"). A worker that starts marks failed
the same way any job still queued or running whose owner process is gone (it was killed), and removes
that job's leftover temp files unless another job is writing the directory now.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from reshard.errors import NotFoundError, ReshardError
from reshard.io.outfs import remove_stale_temps
from reshard.io.writer import write_shards
from reshard.plan.types import Plan, rank_file_name
from reshard.service.catalog import Catalog, ServedCheckpoint
from reshard.service.digests import DigestCache
from reshard.service.process import is_alive, this_process
from reshard.service.ranges import shard_etag
from reshard.service.settings import Settings
from reshard.service.state import StateDB

log = logging.getLogger("reshard.service")
STATES = ("queued", "running", "done", "failed")
PROGRESS_EVERY = 0.25
INTERRUPTED = "the server stopped before this job finished; only complete rank files were published; submit it again"


class JobInterrupted(ReshardError):
    """The server stopped (or was killed) while the job was queued or running."""


@dataclass
class Job:
    id: str
    checkpoint: str
    tp: int
    ranks: list[int]
    rules: str | None
    plan: str
    output_dir: Path
    bytes_total: int
    state: str = "queued"
    bytes_done: int = 0
    outputs: list[str] = field(default_factory=list)
    error: dict[str, str] | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        """Every field (the saved record and the `JobOut` body); `output_dir` as a string."""
        obj = {f.name: getattr(self, f.name) for f in fields(self)}
        obj.update(output_dir=str(self.output_dir), outputs=list(self.outputs))
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Job:
        values = {f.name: obj[f.name] for f in fields(cls)}
        if values["state"] not in STATES or not isinstance(values["id"], str):
            raise ValueError(f"bad job record {obj!r:.200}")
        return cls(**{**values, "output_dir": Path(values["output_dir"])})

    def interrupt(self) -> None:
        self.state, self.finished_at = "failed", time.time()
        self.error = {"error": JobInterrupted.__name__, "detail": INTERRUPTED}


class JobManager:
    """Submit, run and look up write jobs; `state` is shared with the other workers."""

    def __init__(self, settings: Settings, catalog: Catalog, digests: DigestCache | None = None,
                 state: StateDB | None = None) -> None:
        self.out, self.state_dir = settings.out_dir, settings.jobs_dir
        self.catalog, self.digests = catalog, digests
        self.max_kept = settings.max_jobs_kept
        self.state = state if state is not None else StateDB(settings.jobs_dir)
        self._owner = this_process()
        self._pool = ThreadPoolExecutor(settings.job_workers, thread_name_prefix="reshard-job")
        self._mine: dict[str, Job] = {}  # jobs this process runs, fresher than the state database while they run
        self._lock = threading.Lock()
        self._futures: dict[str, Future[None]] = {}
        self._stopping = threading.Event()
        self._recover()

    def submit(self, name: str, tp: int, *, ranks: list[int] | None = None, rules: str | None = None) -> Job:
        src = self.catalog.source(name, rules=rules)
        plan = self.catalog.plan(src, tp, ranks=sorted(set(ranks)) if ranks is not None else None)
        out_dir = self.out / name / f"tp-{tp}"
        job = Job(uuid.uuid4().hex, name, tp, [rp.rank for rp in plan.ranks], rules, plan.digest, out_dir,
                  sum(rp.size for rp in plan.ranks))
        with self._lock:
            self._mine[job.id] = job
        self.state.put_job(job.to_json(), owner=self._owner)
        self.state.forget_old_jobs(self.max_kept)
        with self._lock:
            self._futures[job.id] = self._pool.submit(self._run, job, src, plan)
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._mine.get(job_id)
        if job is not None:
            return job
        record = self.state.get_job(job_id)
        if record is not None and record["state"] in ("queued", "running"):
            self._recover()  # its worker may have died since this one started (killed with the server)
            record = self.state.get_job(job_id)
        if record is None:
            raise NotFoundError(f"no job {job_id!r} (the newest {self.max_kept} jobs are kept)")
        return Job.from_json(record)

    def list_jobs(self) -> list[Job]:
        with self._lock:
            mine = dict(self._mine)
        self._recover()  # jobs of workers that died since this one started are failed, not running
        return [mine.get(r["id"]) or Job.from_json(r) for r in self.state.list_jobs()]

    def counts(self) -> dict[str, int]:
        return {**dict.fromkeys(STATES, 0), **self.state.job_counts()}

    def stop(self) -> None:
        """Refuse to start queued jobs and interrupt the running one at its next chunk. Only sets an
        event: the server's SIGTERM handler calls it (once, `stop_on_signals`), before uvicorn drains
        its connections (which can take as long as the slowest download)."""
        self._stopping.set()

    def shutdown(self) -> None:
        """Stop: queued jobs are cancelled, the running one stops at its next chunk; both end `failed`."""
        self.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            cancelled = [self._mine[i] for i, f in self._futures.items() if f.cancelled() and i in self._mine]
        for job in cancelled:
            job.interrupt()
            self._save(job)

    # --- shared state --------------------------------------------------------------------------

    def _save(self, job: Job) -> None:
        try:
            self.state.put_job(job.to_json(), owner=self._owner)
        except Exception as e:  # noqa: BLE001 - the job itself goes on; only other workers would not see it
            log.warning("cannot save the state of job %s: %s", job.id, e)

    @contextmanager
    def _dir_lock(self, out_dir: Path, *, wait: bool = True) -> Iterator[bool]:
        """Hold the output directory's lock (shared by every worker process); yields False when
        `wait` is off and another job holds it."""
        locks = self.state_dir / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        path = locks / (hashlib.sha256(str(out_dir).encode()).hexdigest()[:32] + ".lock")
        with open(path, "a+b") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _recover(self) -> None:
        """Jobs left queued or running by a worker that is gone are marked failed, their temps removed."""
        for record, owner in self.state.unfinished_jobs():
            if is_alive(owner):
                continue
            try:
                job = Job.from_json(record)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring unreadable job record %s: %s", record.get("id"), e)
                continue
            job.interrupt()
            if job.output_dir.is_dir():
                with self._dir_lock(job.output_dir, wait=False) as free:
                    if free:  # else a live job writes there now; its temps are its own
                        remove_stale_temps(job.output_dir)
            self._save(job)

    def _run(self, job: Job, src: ServedCheckpoint, plan: Plan) -> None:
        try:
            with self._dir_lock(job.output_dir):
                if self._stopping.is_set():
                    job.interrupt()
                    self._save(job)
                    return
                job.state, job.started_at = "running", time.time()
                if not self.state.claim_job(job.to_json(), owner=self._owner):
                    log.warning("job %s was no longer queued; not run again", job.id)
                    return
                try:
                    self._write(job, src, plan)
                    job.state = "done"
                except JobInterrupted:
                    job.interrupt()
                except ReshardError as e:
                    job.error = {"error": type(e).__name__, "detail": str(e)}
                    job.state = "failed"
                except Exception as e:  # an OSError (disk full...) or a bug: the job fails, the server stays up
                    log.exception("job %s failed", job.id)
                    job.error = {"error": type(e).__name__, "detail": str(e)}
                    job.state = "failed"
                finally:
                    job.finished_at = time.time()
                    self._save(job)
        finally:
            with self._lock:
                self._mine.pop(job.id, None)
                self._futures.pop(job.id, None)

    def _write(self, job: Job, src: ServedCheckpoint, plan: Plan) -> None:
        """`reshard.io.writer.write_shards`, counting bytes for the job and caching the digests."""
        saved = [time.monotonic()]

        def on_bytes(n: int) -> None:
            if self._stopping.is_set():
                raise JobInterrupted(INTERRUPTED)
            job.bytes_done += n
            now = time.monotonic()
            if now - saved[0] >= PROGRESS_EVERY:
                saved[0] = now
                self._save(job)

        record = write_shards(src.ckpt, plan, job.output_dir, progress=False, on_bytes=on_bytes)
        job.bytes_done = job.bytes_total  # rank files an earlier run published were kept, not rewritten
        for rp in plan.ranks:
            name = rank_file_name(rp.rank, rp.tp)
            job.outputs.append(str(job.output_dir / name))
            if self.digests is not None:
                self.digests.put(shard_etag(plan.digest, rp.rank), record["files"][name]["sha256"])
