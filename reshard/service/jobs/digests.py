"""sha256 digests of shards by ETag, shared by every worker through the state database.

The database is a cache here, never a dependency: when it cannot be read or written (a full or
read-only file system: `StateUnavailableError`, which it logs once), a digest is computed or passed on
as if it were not there, so downloads and `/digest` answer as usual.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading

from reshard.errors import StateUnavailableError
from reshard.io.rank_stream import RankStream
from reshard.plan.types import RankPlan
from reshard.service.catalog import LRU
from reshard.service.jobs.state import StateDB


class DigestCache:
    """sha256 of a shard by ETag: an LRU in front of the state database every worker shares (if given), so a
    digest computed by one worker is seen by all; computed at most once at a time per ETag per worker."""

    def __init__(self, maxsize: int, state: StateDB | None = None) -> None:
        self._cache: LRU[str, str] = LRU(maxsize)
        self._state = state
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, etag: str) -> str | None:
        hit = self._cache.get(etag)
        if hit is None and self._state is not None:
            try:
                hit = self._state.get_digest(etag)
            except StateUnavailableError:
                return None
            if hit is not None:
                self._cache.put(etag, hit)
        return hit

    def put(self, etag: str, sha256: str) -> None:
        self._cache.put(etag, sha256)
        if self._state is not None:
            with contextlib.suppress(StateUnavailableError):  # the other workers compute it once more
                self._state.put_digest(etag, sha256)

    def compute(self, etag: str, plan: RankPlan, *, chunk_size: int) -> tuple[str, bool]:
        """(sha256, was cached); blocking: call from a worker thread."""
        hit = self.get(etag)
        if hit is not None:
            return hit, True
        with self._guard:
            lock = self._locks.setdefault(etag, threading.Lock())
        with lock:
            hit = self.get(etag)
            if hit is not None:
                return hit, True
            sha = hashlib.sha256()
            with RankStream(plan, chunk_size=chunk_size) as stream:
                for view in stream.chunks(reuse=True):
                    sha.update(view)
            digest = sha.hexdigest()
            self.put(etag, digest)
        with self._guard:
            self._locks.pop(etag, None)
        return digest, False
