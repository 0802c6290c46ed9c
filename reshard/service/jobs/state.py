"""The state every worker process of `reshard serve` shares: write jobs and shard digests, in SQLite.

One database file, OUT/.jobs/state.sqlite3 (a directory no checkpoint name can reach), opened by every
worker through one connection per process (a busy timeout for concurrent writers). A job row holds the
job's JSON record plus the columns queries need (state, owner, creation time); the owner is the worker
process running it (pid and start time, so a reused pid is not mistaken for it). Digests are the sha256
of a shard by ETag, the newest `max_digests` kept.

The database may fail under the service, and nothing but the job routes may notice:

- Its file system is full, or its files are read-only or immutable: every operation that fails raises
  `StateFullError` (507) or `StateUnavailableError` (503), the worker logs it once (and once more when
  a write succeeds again; at most once a minute), and the next operation reopens the connection, so the service recovers by
  itself when the cause goes away. The journal is a rollback journal (`TRUNCATE`), not a WAL: a WAL's
  shared-memory file is mapped, and a write to a mapped page of a file made immutable kills the worker
  with SIGBUS, downloads and all.
- Its file is deleted or replaced (an operator's `rm`): each operation compares the identity of the file
  at the path (device, inode) with the one the connection has open; when they differ, the connection
  is reopened at the path (and the file created afresh when missing, its stale journal removed first),
  the worker logs it, and `on_reopen` callbacks run (the job manager saves its live jobs again). So all
  workers end up on one file, whichever of them (or a restarted one) noticed first.

Opening (and creating) the file is serialized across workers by an `flock` on `state.lock` beside it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from reshard.errors import StateFullError, StateUnavailableError
from reshard.service.http_errors import status_for

log = logging.getLogger("reshard.service")
T = TypeVar("T")

DB_NAME = "state.sqlite3"
LOCK_NAME = "state.lock"
_SIDE_FILES = ("-journal", "-wal", "-shm")  # a deleted database's journal must not be applied to a new one
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, owner TEXT NOT NULL, created_at REAL NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at);
CREATE TABLE IF NOT EXISTS digests (etag TEXT PRIMARY KEY, sha256 TEXT NOT NULL, seq INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS digests_seq ON digests (seq);
"""
_FULL_CODES = frozenset({sqlite3.SQLITE_FULL})
_BUG = (sqlite3.ProgrammingError, sqlite3.IntegrityError, sqlite3.InterfaceError)
_FIX = "see the server log; shard downloads are not affected"
FAULT_LOG_EVERY = 60.0  # seconds: a failure of the same kind is logged at most this often per worker


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class StateDB:
    """Jobs and digests shared by the server's worker processes."""

    def __init__(self, directory: Path, *, max_digests: int = 4096) -> None:
        self.directory = directory
        self.path = directory / DB_NAME
        self.max_digests = max_digests
        # one connection per process, used under a lock: a few fds, whatever the number of threads
        self._conn: sqlite3.Connection | None = None
        self._ident: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._fault: str | None = None  # the class of the current failure, until a write succeeds
        self._fault_logged = False
        self._logged: dict[str, float] = {}  # failure class -> when it was last logged (monotonic)
        self._reopened = False
        self._listeners: list[Callable[[], None]] = []
        with contextlib.suppress(StateUnavailableError):  # a store that fails now is retried by each operation
            self._do(lambda db: None, write=False)

    def on_reopen(self, callback: Callable[[], None]) -> None:
        """Call `callback` (outside any lock) after the database was found deleted or replaced and reopened."""
        self._listeners.append(callback)

    # --- the connection ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """The workers' lock around opening (and creating) the database file."""
        lock_path = self.directory / LOCK_NAME
        while True:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                st = os.fstat(fd)
                if _identity(lock_path) == (st.st_dev, st.st_ino):  # not a lock file deleted meanwhile
                    yield
                    return
            finally:
                os.close(fd)

    def _connection(self) -> sqlite3.Connection:
        """The open connection (call under `_lock`), (re)opened when there is none or the file at the
        path is not the one it has open."""
        ident = _identity(self.path)
        if self._conn is not None and ident == self._ident:
            return self._conn
        changed = self._ident is not None and ident != self._ident  # (before closing: the inode may be reused)
        self._close()
        known_before = (self.directory / LOCK_NAME).exists()  # not the first start of a service here
        with self._file_lock():
            created = _identity(self.path) is None
            if created:
                for suffix in _SIDE_FILES:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(f"{self.path}{suffix}")
            conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            try:
                conn.execute("PRAGMA journal_mode=TRUNCATE")
                conn.execute("PRAGMA synchronous=NORMAL")
                tables = conn.execute("SELECT COUNT(*) FROM sqlite_master WHERE name IN ('jobs', 'digests')").fetchone()
                if tables[0] < 2:
                    conn.executescript(_SCHEMA)
                opened = _identity(self.path)
            except BaseException:
                conn.close()
                raise
        if changed:
            log.warning("state database %s was %s while this worker had it open; %s: jobs recorded only in the old "
                        "file are no longer known (this worker's live jobs are saved again)", self.path,
                        "deleted" if ident is None else "replaced",
                        "created a new one" if created else "opened the one now there")
            self._reopened = True
        elif created and known_before and self._ident is None:
            log.warning("state database %s was missing (deleted?); created a new one: jobs recorded before are no "
                        "longer known", self.path)
        self._conn, self._ident = conn, opened
        return conn

    def _close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()
            self._conn = None

    def _failed(self, e: BaseException) -> StateUnavailableError:
        """The error to raise for a failure of the database (logged once until a write succeeds again)."""
        code = getattr(e, "sqlite_errorcode", None)
        full = (code is not None and code & 0xFF in _FULL_CODES) or getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        cause = str(e) if not isinstance(e, OSError) else (e.strerror or str(e))
        err: StateUnavailableError
        if full:
            err = StateFullError(f"the server's job database ({DB_NAME}) cannot be written: its file system is "
                                 f"full; free some space there, then try again ({_FIX})")
        else:
            err = StateUnavailableError(f"the server's job database ({DB_NAME}) cannot be used: {cause}; "
                                        f"make it writable again, then try again ({_FIX})")
        name = type(err).__name__
        if self._fault != name:
            now = time.monotonic()
            self._fault, self._fault_logged = name, now - self._logged.get(name, -FAULT_LOG_EVERY) >= FAULT_LOG_EVERY
            if self._fault_logged:  # a file system at its last blocks flips between failing and not: once a minute
                self._logged[name] = now
                log.warning("state database %s: %s (%s); job routes answer %d until it works again, shard "
                            "downloads go on", self.path, cause, getattr(e, "sqlite_errorname", type(e).__name__),
                            status_for(err))
        return err

    def _do(self, fn: Callable[[sqlite3.Connection], T], *, write: bool) -> T:
        """`fn(connection)`, in one write transaction if `write` (BEGIN IMMEDIATE: the write lock is taken
        up front, no upgrade deadlock); a failure of the database as `StateUnavailableError`."""
        with self._lock:
            try:
                db = self._connection()
                if write:
                    db.execute("BEGIN IMMEDIATE")
                    try:
                        out = fn(db)
                        db.execute("COMMIT")
                    except BaseException:
                        with contextlib.suppress(sqlite3.Error):
                            db.execute("ROLLBACK")
                        raise
                else:
                    out = fn(db)
            except _BUG:
                raise
            except (sqlite3.DatabaseError, OSError) as e:
                self._close()  # reopened by the next operation: a read-only connection does not heal by itself
                raise self._failed(e) from e
            if write and self._fault is not None:
                if self._fault_logged:
                    log.warning("state database %s is writable again", self.path)
                self._fault = None
            reopened, self._reopened = self._reopened, False
        if reopened:
            for callback in self._listeners:
                try:
                    callback()
                except Exception as e:  # noqa: BLE001 - one listener's failure must not fail this operation
                    log.warning("after reopening the state database: %s", e)
        return out

    # --- jobs --------------------------------------------------------------------------------

    def put_job(self, record: dict[str, Any], *, owner: str) -> None:
        self._do(lambda db: db.execute(
            "INSERT OR REPLACE INTO jobs (id, state, owner, created_at, record) VALUES (?, ?, ?, ?, ?)",
            (record["id"], record["state"], owner, record["created_at"], json.dumps(record))), write=True)

    def claim_job(self, record: dict[str, Any], *, owner: str) -> bool:
        """Store `record` (state running) only if the job is still queued: true for exactly one caller."""
        cur = self._do(lambda db: db.execute(
            "UPDATE jobs SET state = ?, owner = ?, record = ? WHERE id = ? AND state = 'queued'",
            (record["state"], owner, json.dumps(record), record["id"])), write=True)
        return cur.rowcount == 1

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        row = self._do(lambda db: db.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone(), write=False)
        return json.loads(row[0]) if row else None

    def list_jobs(self) -> list[dict[str, Any]]:
        rows = self._do(lambda db: db.execute("SELECT record FROM jobs ORDER BY created_at, id").fetchall(), write=False)
        return [json.loads(r[0]) for r in rows]

    def job_counts(self) -> dict[str, int]:
        return dict(self._do(lambda db: db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall(),
                             write=False))

    def unfinished_jobs(self) -> list[tuple[dict[str, Any], str]]:
        rows = self._do(lambda db: db.execute(
            "SELECT record, owner FROM jobs WHERE state IN ('queued', 'running')").fetchall(), write=False)
        return [(json.loads(r), owner) for r, owner in rows]

    def forget_old_jobs(self, keep: int) -> list[str]:
        """Delete the oldest finished jobs beyond the newest `keep`; their ids."""

        def forget(db: sqlite3.Connection) -> list[str]:
            (total,) = db.execute("SELECT COUNT(*) FROM jobs").fetchone()
            if total <= keep:
                return []
            ids = [r[0] for r in db.execute(
                "SELECT id FROM jobs WHERE state IN ('done', 'failed') ORDER BY created_at, id LIMIT ?",
                (total - keep,))]
            db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])
            return ids

        return self._do(forget, write=True)

    # --- digests -----------------------------------------------------------------------------

    def get_digest(self, etag: str) -> str | None:
        row = self._do(lambda db: db.execute("SELECT sha256 FROM digests WHERE etag = ?", (etag,)).fetchone(),
                       write=False)
        return row[0] if row else None

    def put_digest(self, etag: str, sha256: str) -> None:
        def put(db: sqlite3.Connection) -> None:
            (seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM digests").fetchone()
            db.execute("INSERT OR REPLACE INTO digests (etag, sha256, seq) VALUES (?, ?, ?)", (etag, sha256, seq))
            db.execute("DELETE FROM digests WHERE seq <= ?", (seq - self.max_digests,))

        self._do(put, write=True)
