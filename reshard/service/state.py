"""The state every worker process of `reshard serve` shares: write jobs and shard digests, in SQLite.

One database file, OUT/.jobs/state.sqlite3 (a directory no checkpoint name can reach), opened by every
worker (WAL mode, so readers never wait for the writer; a busy timeout for concurrent writers), through one
connection per process. A job row holds the job's JSON record plus the columns queries need
(state, owner, creation time); the owner is the worker process running it (pid and start time, so a
reused pid is not mistaken for it). Digests are the sha256 of a shard by ETag, the newest
`max_digests` kept.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DB_NAME = "state.sqlite3"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, owner TEXT NOT NULL, created_at REAL NOT NULL, record TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created_at);
CREATE TABLE IF NOT EXISTS digests (etag TEXT PRIMARY KEY, sha256 TEXT NOT NULL, seq INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS digests_seq ON digests (seq);
"""


class StateDB:
    """Jobs and digests shared by the server's worker processes."""

    def __init__(self, directory: Path, *, max_digests: int = 4096) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / DB_NAME
        self.max_digests = max_digests
        # one connection per process, used under a lock: a few fds, whatever the number of threads
        self._conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            yield self._conn

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: the write lock is taken up front, no upgrade deadlock)."""
        with self._lock:
            db = self._conn
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # --- jobs --------------------------------------------------------------------------------

    def put_job(self, record: dict[str, Any], *, owner: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO jobs (id, state, owner, created_at, record) VALUES (?, ?, ?, ?, ?)",
                       (record["id"], record["state"], owner, record["created_at"], json.dumps(record)))

    def claim_job(self, record: dict[str, Any], *, owner: str) -> bool:
        """Store `record` (state running) only if the job is still queued: true for exactly one caller."""
        with self._tx() as db:
            cur = db.execute("UPDATE jobs SET state = ?, owner = ?, record = ? WHERE id = ? AND state = 'queued'",
                             (record["state"], owner, json.dumps(record), record["id"]))
            return cur.rowcount == 1

    def get_job(self, job_id: str) -> dict[str, Any] | None:
        with self._read() as db:
            row = db.execute("SELECT record FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def list_jobs(self) -> list[dict[str, Any]]:
        with self._read() as db:
            rows = db.execute("SELECT record FROM jobs ORDER BY created_at, id").fetchall()
        return [json.loads(r[0]) for r in rows]

    def job_counts(self) -> dict[str, int]:
        with self._read() as db:
            return dict(db.execute("SELECT state, COUNT(*) FROM jobs GROUP BY state").fetchall())

    def unfinished_jobs(self) -> list[tuple[dict[str, Any], str]]:
        with self._read() as db:
            rows = db.execute("SELECT record, owner FROM jobs WHERE state IN ('queued', 'running')").fetchall()
        return [(json.loads(r), owner) for r, owner in rows]

    def forget_old_jobs(self, keep: int) -> list[str]:
        """Delete the oldest finished jobs beyond the newest `keep`; their ids."""
        with self._tx() as db:
            (total,) = db.execute("SELECT COUNT(*) FROM jobs").fetchone()
            if total <= keep:
                return []
            ids = [r[0] for r in db.execute(
                "SELECT id FROM jobs WHERE state IN ('done', 'failed') ORDER BY created_at, id LIMIT ?",
                (total - keep,))]
            db.executemany("DELETE FROM jobs WHERE id = ?", [(i,) for i in ids])
            return ids

    # --- digests -----------------------------------------------------------------------------

    def get_digest(self, etag: str) -> str | None:
        with self._read() as db:
            row = db.execute("SELECT sha256 FROM digests WHERE etag = ?", (etag,)).fetchone()
        return row[0] if row else None

    def put_digest(self, etag: str, sha256: str) -> None:
        with self._tx() as db:
            (seq,) = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM digests").fetchone()
            db.execute("INSERT OR REPLACE INTO digests (etag, sha256, seq) VALUES (?, ?, ?)", (etag, sha256, seq))
            db.execute("DELETE FROM digests WHERE seq <= ?", (seq - self.max_digests,))
