"""sha256 off the critical path: a background hasher for streamed bytes, and a file's digest."""

from __future__ import annotations

import hashlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any


class BackgroundHash:
    """Feeds a hashlib object from one worker thread (hashlib releases the GIL on large updates), so
    hashing overlaps receiving. Pieces are immutable `bytes`, batched to ~4 MiB; at most a few batches
    are in flight. With `backlog=None` the pieces are views of memory that stays as it is (parameters
    already filled) and any number may wait: the producer never waits for the hash. A no-op when `sha`
    is None. Leaving the `with` block waits for the last batch."""

    _BATCH = 4 << 20

    def __init__(self, sha: Any, *, backlog: int | None = 3) -> None:
        self.sha, self.active, self.backlog = sha, sha is not None, backlog
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="reshard-sha") if self.active else None
        self._batch: list[bytes | memoryview] = []
        self._bytes = 0
        self._pending: deque[Future[None]] = deque()

    def __enter__(self) -> BackgroundHash:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._flush()
            self._drain(0)
            self._pool.shutdown()

    def update(self, piece: bytes | memoryview) -> None:
        if self._pool is None:
            return
        self._batch.append(piece)
        self._bytes += len(piece)
        if self._bytes >= self._BATCH:
            self._flush()
            if self.backlog is not None:
                self._drain(self.backlog)

    def wait(self) -> None:
        """Return once every piece given so far is hashed (its memory may then change)."""
        self._flush()
        self._drain(0)

    def hexdigest(self) -> str:
        self.wait()
        return self.sha.hexdigest()

    def _flush(self) -> None:
        if self._batch and self._pool is not None:
            batch, self._batch, self._bytes = self._batch, [], 0
            self._pending.append(self._pool.submit(self._hash, batch))

    def _drain(self, keep: int) -> None:
        while len(self._pending) > keep:
            self._pending.popleft().result()

    def _hash(self, batch: list[bytes | memoryview]) -> None:
        for piece in batch:
            self.sha.update(piece)


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 8 MiB blocks into one buffer."""
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = memoryview(bytearray(8 << 20))
        while n := f.readinto(buf):
            sha.update(buf[:n])
    return sha.hexdigest()
