"""Background write jobs: rank files of a checkpoint into OUT/NAME/tp-N, with progress in memory.

A job is planned when it is submitted (so bad input is a 4xx answer, not a failed job), then written
by a small thread pool with the same `write_shards` as `reshard write`: each file atomic, then
`reshard.json`. Jobs writing the same output directory run one after another. Job state lives in
memory on `app.state.jobs`; the newest `max_jobs_kept` are remembered.

Each job's state is also saved (atomically, at every change of state) as OUT/.jobs/ID.json, a
directory no checkpoint name can reach. A server that stops mid-job never half-publishes: rank files
appear only complete, under their final names. When it stops gracefully, the running job is
interrupted at its next chunk and queued ones are cancelled; either way they are reported `failed`
("interrupted"), and on start-up any job still recorded as queued or running (the server was killed)
is marked failed the same way, its leftover temp files removed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from reshard.errors import NotFoundError, ReshardError
from reshard.plan import Plan, rank_file_name
from reshard.writer import remove_stale_temps, write_json_atomic, write_shards
from service.catalog import Catalog, Source
from service.settings import Settings
from service.streaming import DigestCache, shard_etag

log = logging.getLogger("reshard.service")
STATES = ("queued", "running", "done", "failed")
STATE_DIR = ".jobs"
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
    """Submit, run and look up write jobs."""

    def __init__(self, settings: Settings, catalog: Catalog, digests: DigestCache | None = None) -> None:
        self.out = settings.out_dir
        self.catalog, self.digests = catalog, digests
        self.max_kept = settings.max_jobs_kept
        self._pool = ThreadPoolExecutor(settings.job_workers, thread_name_prefix="reshard-job")
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self._lock = threading.Lock()
        self._dir_locks: dict[Path, threading.Lock] = {}
        self._futures: dict[str, Future[None]] = {}
        self._stopping = threading.Event()
        self._state_dir = self.out / STATE_DIR
        self._recover()

    def submit(self, name: str, tp: int, *, ranks: list[int] | None = None, rules: str | None = None) -> Job:
        src = self.catalog.source(name, rules=rules)
        plan = self.catalog.plan(src, tp, ranks=sorted(set(ranks)) if ranks is not None else None)
        out_dir = self.out / name / f"tp-{tp}"
        job = Job(uuid.uuid4().hex, name, tp, [rp.rank for rp in plan.ranks], rules, plan.digest, out_dir,
                  sum(rp.size for rp in plan.ranks))
        with self._lock:
            self._jobs[job.id] = job
            self._forget_old()
            lock = self._dir_locks.setdefault(out_dir, threading.Lock())
        self._save(job)
        with self._lock:
            self._futures[job.id] = self._pool.submit(self._run, job, src, plan, lock)
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise NotFoundError(f"no job {job_id!r} (jobs are kept in memory; the newest {self.max_kept})")
        return job

    def list_jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    def counts(self) -> dict[str, int]:
        with self._lock:
            counts = dict.fromkeys(STATES, 0)
            for job in self._jobs.values():
                counts[job.state] += 1
            return counts

    def stop(self) -> None:
        """Refuse to start queued jobs and interrupt the running one at its next chunk. Only sets an
        event, so a signal handler may call it: the server's SIGTERM does, before uvicorn drains its
        connections (which can take as long as the slowest download)."""
        self._stopping.set()

    def shutdown(self) -> None:
        """Stop: queued jobs are cancelled, the running one stops at its next chunk; both end `failed`."""
        self.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            cancelled = [self._jobs[i] for i, f in self._futures.items() if f.cancelled() and i in self._jobs]
        for job in cancelled:
            job.interrupt()
            self._save(job)

    # --- saved state -------------------------------------------------------------------------

    def _save(self, job: Job) -> None:
        try:
            self._state_dir.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self._state_dir / f"{job.id}.json", job.to_json())
        except OSError as e:  # the job itself goes on; only a restart would not know it
            log.warning("cannot save the state of job %s: %s", job.id, e)

    def _recover(self) -> None:
        """Load saved jobs; those a stopped server left queued or running are marked failed."""
        if not self._state_dir.is_dir():
            return
        remove_stale_temps(self._state_dir)
        jobs = []
        for path in sorted(self._state_dir.glob("*.json")):
            try:
                job = Job.from_json(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("ignoring unreadable job record %s: %s", path.name, e)
                continue
            if job.state in ("queued", "running"):
                job.interrupt()
                if job.output_dir.is_dir():
                    remove_stale_temps(job.output_dir)
                self._save(job)
            jobs.append(job)
        for job in sorted(jobs, key=lambda j: j.created_at)[-self.max_kept :]:
            self._jobs[job.id] = job

    def _forget_old(self) -> None:
        while len(self._jobs) > self.max_kept:
            oldest = next((k for k, j in self._jobs.items() if j.state in ("done", "failed")), None)
            if oldest is None:
                return
            del self._jobs[oldest]
            self._futures.pop(oldest, None)
            (self._state_dir / f"{oldest}.json").unlink(missing_ok=True)

    def _run(self, job: Job, src: Source, plan: Plan, lock: threading.Lock) -> None:
        with lock:
            if self._stopping.is_set():
                job.interrupt()
                self._save(job)
                return
            job.state, job.started_at = "running", time.time()
            self._save(job)
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

    def _write(self, job: Job, src: Source, plan: Plan) -> None:
        """`reshard.writer.write_shards`, counting bytes for the job and caching the digests."""

        def on_bytes(n: int) -> None:
            if self._stopping.is_set():
                raise JobInterrupted(INTERRUPTED)
            job.bytes_done += n

        record = write_shards(src.ckpt, plan, job.output_dir, progress=False, on_bytes=on_bytes)
        for rp in plan.ranks:
            name = rank_file_name(rp.rank, rp.tp)
            job.outputs.append(str(job.output_dir / name))
            if self.digests is not None:
                self.digests.put(shard_etag(plan.digest, rp.rank), record["files"][name]["sha256"])


