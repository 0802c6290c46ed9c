"""The sha256 of a file being written, taken from the bytes as they go out: nothing is read back.

    pool = Buffers(CHUNK)                  # shared by the files of one write
    hasher = OutHash(pool)
    buf = pool.take()                      # a buffer of the pool: fill it, write it, then
    hasher.written(buf, n)                 # hashed from it, then back to the pool
    hasher.copied(src_fd, offset, n)       # a range the kernel copied (copy_file_range) from a source file
    digest = hasher.digest()               # after the last byte

One thread per file hashes in order, behind the writer. A range the kernel copied is hashed from its
source file: through a leased mapping where `reshard.io.mapped` has one (no copy; `reshard write`
turns them on), else read in blocks (the page cache's copy). Written buffers are hashed from the
buffer itself before it is lent again; the pool is small (`BUFFERS` chunks, shared by the files a
write has open), so a writer that runs ahead of the hash waits for a buffer instead of growing memory. Before, the finished file was read
back whole to hash it: a second pass over every byte, and at the end of each file a wait for it.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from typing import Any

from reshard.errors import SourceChangedError
from reshard.io.mapped import MAPS

BUFFERS = 2  # one filled and written while the other is hashed
BLOCK = 4 << 20  # bytes hashed from a mapping (or read) at a time


class Buffers:
    """At most `count` buffers of `chunk` bytes, lent by `take` and given back by the hashers."""

    def __init__(self, chunk: int, count: int = BUFFERS) -> None:
        self.chunk, self._left = chunk, count
        self._free: queue.Queue[memoryview] = queue.Queue()

    def take(self, hasher: OutHash | None = None) -> memoryview:
        """A free buffer (made on demand; else wait for one). If `hasher` failed, a fresh one: the
        write goes on to its end, where `digest` raises why."""
        if self._free.empty() and self._left > 0:
            self._left -= 1
            return memoryview(bytearray(self.chunk))
        while True:
            try:
                return self._free.get(timeout=1.0)
            except queue.Empty:
                if hasher is not None and (hasher.error is not None or not hasher.is_alive()):
                    return memoryview(bytearray(self.chunk))

    def give(self, buf: memoryview) -> None:
        self._free.put(buf)


class OutHash(threading.Thread):
    def __init__(self, pool: Buffers) -> None:
        super().__init__(daemon=True, name="reshard-outhash")
        self.sha = hashlib.sha256()
        self.pool = pool
        self._todo: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._scratch: memoryview | None = None
        self.cancelled = False
        self.error: BaseException | None = None
        self.start()

    def take(self) -> memoryview:
        """A buffer of the pool to fill, write and hand to `written`."""
        return self.pool.take(self)

    def written(self, buf: memoryview, n: int) -> None:
        """buf[:n] went out: hash it, then give `buf` back to the pool."""
        self._todo.put(("buf", buf, n))

    def copied(self, fd: int, offset: int, n: int) -> None:
        """Bytes [offset, offset+n) of the source file open on `fd` went out by a kernel copy (and the
        file was as planned then: the writer checks)."""
        st = os.fstat(fd)
        self._todo.put(("src", os.dup(fd), offset, n, (st.st_size, st.st_mtime_ns)))  # the caller may close its fd

    def cancel(self) -> None:
        """The write failed: stop at once (`digest` then only joins)."""
        self.cancelled = True
        self._todo.put(None)

    def run(self) -> None:
        try:
            while (item := self._todo.get()) is not None:
                if item[0] == "buf":
                    _, buf, n = item
                    if not self.cancelled:
                        self.sha.update(buf[:n])
                    self.pool.give(buf)
                else:
                    _, fd, offset, n, key = item
                    try:
                        if not self.cancelled:
                            self._hash_file(fd, offset, n)
                            _check_same(fd, key)
                    finally:
                        os.close(fd)
        except BaseException as e:  # reported by digest()
            self.error = e
            while (item := self._todo.get()) is not None:  # give back and close what is still queued
                if item[0] == "src":
                    os.close(item[1])
                else:
                    self.pool.give(item[1])

    def _hash_file(self, fd: int, offset: int, n: int) -> None:
        done = MAPS.hash_range(fd, self.sha, offset, n, block=BLOCK)
        if done < n and self._scratch is None:
            self._scratch = memoryview(bytearray(BLOCK))
        while done < n:
            assert self._scratch is not None
            k = os.preadv(fd, [self._scratch[: min(BLOCK, n - done)]], offset + done)
            if k <= 0:
                raise OSError(f"source ended at byte {offset + done} while it was hashed")
            self.sha.update(self._scratch[:k])
            done += k

    def digest(self) -> str:
        """The sha256 of every byte handed over (raises what failed the hash)."""
        if not self.cancelled:
            self._todo.put(None)
        self.join()
        if self.error is not None:
            raise self.error
        return self.sha.hexdigest()


def _check_same(fd: int, key: tuple[int, int]) -> None:
    """The source is still the file that was copied: else its bytes just hashed may not be those copied."""
    st = os.fstat(fd)
    if (st.st_size, st.st_mtime_ns) != key:
        raise SourceChangedError(f"a source file changed while the rank file was written (size {st.st_size}, "
                                 f"was {key[0]}); re-plan and write again")
