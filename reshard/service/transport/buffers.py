"""Chunk buffers for shard bodies, reused while streams run and given back when the last one ends.

A chunk handed to the server may be kept by its transport after `send` returns (uvloop writes it
out later), so a buffer is reused only once nothing but the pool refers to it (its reference count:
the memoryview the transport holds keeps a reference to the array it views). Reuse means no fresh
pages per chunk (a fresh 8 MiB buffer is 2,048 page faults); giving every buffer back when a worker's
last stream ends means the worker's memory returns to its base exactly, where freeing buffers into
the allocator as streams end left the heap fragmented (the base grew from 140 to 275 MiB over the
serving benchmark's runs) or, trimmed at every stream's end, cost page faults under load.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from reshard.service.process.lifecycle import release_freed_memory


class ChunkPool:
    """`take(n, size)` a writable view of n bytes of a `size`-byte buffer; streams say when they
    `open()` and `close()`, and when the last one closes every buffer nobody holds is dropped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bufs: list[np.ndarray] = []
        self._open = 0  # streams open in this process

    def open(self) -> None:
        with self._lock:
            self._open += 1

    def close(self) -> None:
        with self._lock:
            self._open -= 1
            last = not self._open
        if last:
            self.release_all()

    def take(self, n: int, size: int) -> memoryview:
        with self._lock:
            for buf in self._bufs:
                # references: the list, this loop's variable and getrefcount's argument: no one else's
                if len(buf) == size and sys.getrefcount(buf) == 3:
                    return memoryview(buf)[:n]
            buf = np.empty(size, np.uint8)  # not zero-filled: the reader overwrites every byte it hands out
            self._bufs.append(buf)
            return memoryview(buf)[:n]

    def release_all(self) -> None:
        """Drop every buffer nothing else refers to and hand the freed memory back to the OS."""
        with self._lock:
            self._bufs = [b for b in self._bufs if sys.getrefcount(b) > 3]  # list, comprehension var, argument
        release_freed_memory()

    def __len__(self) -> int:
        return len(self._bufs)


POOL = ChunkPool()
