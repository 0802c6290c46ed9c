"""Background write jobs: rank files of a checkpoint into OUT/NAME/tp-N, with progress in memory.

A job is planned when it is submitted (so bad input is a 4xx answer, not a failed job), then written
by a small thread pool with the same `write_rank_file` as `reshard write`: each file atomic, then
`reshard.json`. Jobs writing the same output directory run one after another. Job state lives in
memory on `app.state.jobs`; the newest `max_jobs_kept` are remembered.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reshard.errors import NotFoundError, ReshardError
from reshard.plan import Plan, rank_file_name
from reshard.writer import write_shards
from service.catalog import Catalog, Source
from service.settings import Settings
from service.streaming import DigestCache, shard_etag

log = logging.getLogger("reshard.service")
STATES = ("queued", "running", "done", "failed")


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
        return {
            "id": self.id, "checkpoint": self.checkpoint, "tp": self.tp, "ranks": self.ranks,
            "rules": self.rules, "plan": self.plan, "state": self.state, "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total, "output_dir": str(self.output_dir), "outputs": list(self.outputs),
            "error": self.error, "created_at": self.created_at, "started_at": self.started_at,
            "finished_at": self.finished_at,
        }


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
        self._pool.submit(self._run, job, src, plan, lock)
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

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget_old(self) -> None:
        while len(self._jobs) > self.max_kept:
            oldest = next((k for k, j in self._jobs.items() if j.state in ("done", "failed")), None)
            if oldest is None:
                return
            del self._jobs[oldest]

    def _run(self, job: Job, src: Source, plan: Plan, lock: threading.Lock) -> None:
        with lock:
            job.state, job.started_at = "running", time.time()
            try:
                self._write(job, src, plan)
                job.state = "done"
            except ReshardError as e:
                job.error = {"error": type(e).__name__, "detail": str(e)}
                job.state = "failed"
            except Exception as e:  # an OSError (disk full...) or a bug: the job fails, the server stays up
                log.exception("job %s failed", job.id)
                job.error = {"error": type(e).__name__, "detail": str(e)}
                job.state = "failed"
            finally:
                job.finished_at = time.time()

    def _write(self, job: Job, src: Source, plan: Plan) -> None:
        """`reshard.writer.write_shards`, counting bytes for the job and caching the digests."""

        def on_bytes(n: int) -> None:
            job.bytes_done += n

        record = write_shards(src.ckpt, plan, job.output_dir, progress=False, on_bytes=on_bytes)
        for rp in plan.ranks:
            name = rank_file_name(rp.rank, rp.tp)
            job.outputs.append(str(job.output_dir / name))
            if self.digests is not None:
                self.digests.put(shard_etag(plan.digest, rp.rank), record["files"][name]["sha256"])


