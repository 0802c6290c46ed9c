"""Background write jobs: rank files of a checkpoint into OUT/NAME/tp-N, their state shared by every worker.

A job is checked when it is submitted (its layout and ranks, one rank planned, its planning cost: bad
input is a 4xx answer, not a failed job; a worker takes at most `max_jobs_pending`, 429 beyond), planned
when it starts (queued jobs hold no plan; `bytes_total` is 0 until then), then written by a small thread
pool of the worker process that accepted it, with the same `write_shards` as
`reshard write` (`reshard.io.sinks.write`): each file atomic, then `reshard.json`, the files recorded
as verified. Its state lives in the SQLite database every
worker opens (`reshard.service.jobs.state`), so any worker answers `GET /v1/jobs/{id}`; it is claimed (queued ->
running) in one transaction, so it runs exactly once. Jobs writing the same output directory run one
after another, across workers too (an `flock` per output directory). The newest `max_jobs_kept` are
remembered; progress is saved at most every `PROGRESS_EVERY` seconds, state changes at once.

A server that stops mid-job never half-publishes: rank files appear only complete, under their final
names. When it stops gracefully, the running job is interrupted at its next chunk and queued ones are
cancelled; either way they are reported `failed` ("interrupted"). A job creates the directories of its
output itself and records them; when it fails having published nothing, they are removed again.

A worker that is killed leaves its jobs `running` and its temp files behind. Whoever notices first
cleans up: any worker asked about such a job marks it failed (its owner process is gone) and, once
every thread of the dead process has ended, removes its temp files and the directories it made;
a worker that starts (the supervisor's replacement, or a restart) also sweeps every OUT/NAME/tp-N for
temp files whose writer is gone (`.tmp-PID-*`: no process PID, or one that started after the file's
last write). When the state database cannot be written (`StateUnavailableError`), submitting answers
503/507; a job already running goes on, and its state is saved again once the database works.
"""


from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from reshard.errors import NotFoundError, ReshardError, StateUnavailableError
from reshard.format.rank_file import rank_file_name
from reshard.io.outfs import output_errors
from reshard.io.owners import is_alive, this_process
from reshard.io.sinks.write import write_shards
from reshard.layout.mesh import Layout
from reshard.plan.types import Plan
from reshard.service.catalog import Catalog, ServedCheckpoint
from reshard.service.http_errors import ServerPaths, TooBusy
from reshard.service.jobs.digests import DigestCache
from reshard.service.jobs.state import StateDB
from reshard.service.process.leftovers import clean_after, remove_made, sweep_out
from reshard.service.serve_settings import Settings
from reshard.service.transport.ranges import shard_etag

log = logging.getLogger("reshard.service")
STATES = ("queued", "running", "done", "failed")
PROGRESS_EVERY = 0.25
RETRY_SAVE_EVERY = 1.0  # seconds between attempts to save states the state database refused
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
    made_dirs: list[str] = field(default_factory=list)  # what the job created, removed if it fails (not served)
    layout: dict[str, int] | None = None  # the sizes beyond tp, when there are any

    def to_json(self) -> dict[str, Any]:
        """Every field (the saved record and the `JobOut` body); `output_dir` as a string."""
        obj = {f.name: getattr(self, f.name) for f in fields(self)}
        obj.update(output_dir=str(self.output_dir), outputs=list(self.outputs), made_dirs=list(self.made_dirs))
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Job:
        values = {f.name: obj[f.name] for f in fields(cls) if f.name in obj or f.name not in ("made_dirs", "layout")}
        if values["state"] not in STATES or not isinstance(values["id"], str):
            raise ValueError(f"bad job record {obj!r:.200}")
        return cls(**{**values, "output_dir": Path(values["output_dir"])})

    def interrupt(self) -> None:
        self.fail(JobInterrupted.__name__, INTERRUPTED)

    def fail(self, error: str, detail: str) -> None:
        self.state, self.finished_at = "failed", time.time()
        self.error = {"error": error, "detail": detail}


class JobManager:
    """Submit, run and look up write jobs; `state` is shared with the other workers."""

    def __init__(self, settings: Settings, catalog: Catalog, digests: DigestCache | None = None,
                 state: StateDB | None = None) -> None:
        self.out, self.state_dir = settings.out_dir, settings.jobs_dir
        self.catalog, self.digests = catalog, digests
        self.max_kept, self.max_pending = settings.max_jobs_kept, settings.max_jobs_pending
        self._paths = ServerPaths.of(settings)  # job errors are served: they name no server path
        self.state = state if state is not None else StateDB(settings.jobs_dir)
        self._owner = this_process()
        self._pool = ThreadPoolExecutor(settings.job_workers, thread_name_prefix="reshard-job")
        self._mine: dict[str, Job] = {}  # jobs this process runs, fresher than the state database while they run
        self._unsaved: dict[str, Job] = {}  # states the state database refused, saved again when it works
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._futures: dict[str, Future[None]] = {}
        self._stopping = threading.Event()
        self._counts: dict[str, int] = {}
        self._retrying = False
        self.state.on_reopen(self._save_live)
        self._recover(sweep=True)

    def submit(self, name: str, layout: Layout, *, ranks: list[int] | None = None, rules: str | None = None) -> Job:
        """Check the job (its source, its layout and ranks, its planning cost: `Catalog.check_work`; one
        rank planned, so a bad rule is a 4xx answer) and queue it; its plan is made when it starts, so
        queued jobs hold no plan, and this worker holds at most `max_jobs_pending` of them (429 beyond)."""
        with self._lock:
            pending = sum(not f.done() for f in self._futures.values())
        if pending >= self.max_pending:
            raise TooBusy(f"this worker has {pending} write jobs queued or running, as many as it takes "
                          f"(RESHARD_MAX_JOBS_PENDING={self.max_pending}); submit again when one has finished")
        src = self.catalog.source(name, rules=rules)
        chosen = sorted(set(ranks)) if ranks is not None else list(range(layout.world))
        self.catalog.check_work(src, layout, len(chosen), what="a write job")
        probe = self.catalog.plan(src, layout, ranks=chosen[:1])  # every rank's layout checked, one planned
        for r in chosen[1:]:
            layout.check_rank(r)
        out_dir = self.out / name / layout.dir_name()
        job = Job(uuid.uuid4().hex, name, layout.tp, chosen, rules, probe.digest, out_dir, 0,
                  layout=None if layout.tp_only else layout.sizes())
        self.state.put_job(job.to_json(), owner=self._owner)  # a state database that fails: 503 / 507
        with contextlib.suppress(StateUnavailableError):
            self.state.forget_old_jobs(self.max_kept)
        with self._lock:
            self._mine[job.id] = job
            self._futures[job.id] = self._pool.submit(self._run, job, src, layout)
        return job

    def get(self, job_id: str) -> Job:
        with self._lock:
            job = self._mine.get(job_id) or self._unsaved.get(job_id)
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
        self._recover()  # jobs of workers that died since this one started are failed, not running
        records = self.state.list_jobs()
        with self._lock:
            fresh = {**self._unsaved, **self._mine}
        return [fresh.get(r["id"]) or Job.from_json(r) for r in records]

    def counts(self) -> dict[str, int]:
        """Jobs by state (for /metrics); the last known counts while the state database fails."""
        with contextlib.suppress(StateUnavailableError):
            self._counts = self.state.job_counts()
        return {**dict.fromkeys(STATES, 0), **self._counts}

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
        """Save `job`'s state for the other workers; when the state database refuses (it has logged why),
        the state is kept and saved again every `RETRY_SAVE_EVERY` seconds until it works."""
        try:
            with self._save_lock:  # one at a time: an older state never overwrites a newer one
                self.state.put_job(job.to_json(), owner=self._owner)
        except StateUnavailableError:
            with self._lock:
                self._unsaved[job.id] = job
                start, self._retrying = not self._retrying, True
            if start:
                threading.Thread(target=self._retry_unsaved, name="reshard-job-save", daemon=True).start()
            return
        except Exception as e:  # noqa: BLE001 - the job itself goes on; only other workers would not see it
            log.warning("cannot save the state of job %s: %s", job.id, e)
            return
        with self._lock:
            if self._unsaved.get(job.id) is job:
                del self._unsaved[job.id]

    def _retry_unsaved(self) -> None:
        while True:
            time.sleep(RETRY_SAVE_EVERY)
            with self._lock:
                pending = list(self._unsaved.values())
            for job in pending:
                self._save(job)
            with self._lock:
                if not self._unsaved:
                    self._retrying = False
                    return

    def _save_live(self) -> None:
        """The state database was found deleted or replaced: this worker's jobs go into the new one."""
        with self._lock:
            live = [*self._unsaved.values(), *self._mine.values()]
        for job in live:
            self._save(job)

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

    def _recover(self, *, sweep: bool = False) -> None:
        """Jobs left queued or running by a worker that is gone are marked failed and their leftovers
        removed (in the background: the dead worker's threads may still be ending). `sweep` (at start-up):
        a state database that fails is logged, not raised, and every OUT/NAME/tp-N is swept as well."""
        try:
            unfinished = self.state.unfinished_jobs()
        except StateUnavailableError:
            if not sweep:
                raise
            unfinished = []
        for record, owner in unfinished:
            if is_alive(owner):
                continue
            try:
                job = Job.from_json(record)
            except (ValueError, KeyError, TypeError) as e:
                log.warning("ignoring unreadable job record %s: %s", record.get("id"), e)
                continue
            job.interrupt()
            self._save(job)
            if sweep:
                clean_after(job.output_dir, job.made_dirs, owner, self._dir_lock)
            else:
                threading.Thread(target=clean_after, args=(job.output_dir, job.made_dirs, owner, self._dir_lock),
                                 daemon=True, name="reshard-job-clean").start()
        if sweep:
            sweep_out(self.out, self._dir_lock)

    # --- running -------------------------------------------------------------------------------

    def _run(self, job: Job, src: ServedCheckpoint, layout: Layout) -> None:
        try:
            with self._dir_lock(job.output_dir):
                if self._stopping.is_set():
                    job.interrupt()
                    self._save(job)
                    return
                job.state, job.started_at = "running", time.time()
                try:
                    claimed = self.state.claim_job(job.to_json(), owner=self._owner)
                except StateUnavailableError as e:
                    job.fail(type(e).__name__, f"{e}; the job was not started: submit it again")
                    self._save(job)
                    return
                if not claimed:
                    log.warning("job %s was no longer queued; not run again", job.id)
                    return
                try:
                    plan = self.catalog.plan(src, layout, ranks=job.ranks)  # planned as it starts: queued jobs hold none
                    job.bytes_total = sum(rp.size for rp in plan.ranks)
                    self._make_dirs(job)
                    self._save(job)
                    self._write(job, src, plan)
                    job.state = "done"
                except JobInterrupted:
                    job.interrupt()
                except ReshardError as e:
                    log.warning("job %s failed: %s", job.id, e)
                    job.fail(type(e).__name__, self._paths.hide(str(e)))
                except Exception as e:  # an OSError (disk full...) or a bug: the job fails, the server stays up
                    log.exception("job %s failed", job.id)
                    job.fail(type(e).__name__, self._paths.hide(str(e)))
                finally:
                    if job.state == "failed":
                        remove_made(job.made_dirs)
                    job.finished_at = time.time()
                    self._save(job)
        except OSError as e:  # the directory's lock file could not be made (STATE full, read-only...)
            log.warning("job %s failed: %s", job.id, e)
            job.fail(type(e).__name__, self._paths.hide(f"cannot lock the output directory: {e}; submit it again"))
            self._save(job)
        finally:
            with self._lock:
                self._mine.pop(job.id, None)
                self._futures.pop(job.id, None)

    def _make_dirs(self, job: Job) -> None:
        """Create the job's output directory, recording in `job.made_dirs` what did not exist under OUT
        (a failed job of the same checkpoint may remove an empty OUT/NAME meanwhile: then again)."""
        with output_errors(job.output_dir):
            self.out.mkdir(parents=True, exist_ok=True)
        for attempt in range(8):
            chain, p = [], job.output_dir
            while p != self.out and p != p.parent and not os.path.lexists(p):
                chain.append(p)
                p = p.parent
            try:
                with output_errors(job.output_dir):
                    for d in reversed(chain):
                        with contextlib.suppress(FileExistsError):  # made meanwhile, or a file (named next)
                            d.mkdir()
                            job.made_dirs.append(str(d))
                return
            except FileNotFoundError:
                if attempt == 7:
                    raise

    def _write(self, job: Job, src: ServedCheckpoint, plan: Plan) -> None:
        """`reshard.io.sinks.write.write_shards` (the one write path), counting bytes for the job and caching the digests."""
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
            name = rank_file_name(rp.rank, rp.world)
            job.outputs.append(str(job.output_dir / name))
            if self.digests is not None:
                self.digests.put(shard_etag(plan.digest, rp.rank), record["files"][name]["sha256"])
