"""A store object as one stream reads it through the node's block cache (`reshard.io.source.store_cache`):
its blocks as open local files, read the way a local source file is.

    obj = CachedObject(cache, fetch, url, version, size)
    obj.want(lo, hi, submit)            # the blocks behind bytes [lo, hi), fetched ahead by a pool
    for n, src in obj.ranges(off, m, direct_min=...):   # (fd, offset) in a block file, or None
        ...                             # a sink sends `src` with sendfile, then `obj.unpin(src)`
    obj.pread(dst, off)                 # bytes from the block files
    obj.gather(out, off, run, stride, count)    # strided runs from the blocks' mappings
    obj.close()

So a contiguous range goes from the block files to the socket by `sendfile` and a row-split tensor's
runs are copied once by numpy from the mappings, as from local files: no byte is fetched into memory
and copied again (before, every read copied the cached bytes into a buffer, then out of it).

- Open blocks: at most `OPEN` per object stay open (least recently used closed first), except those
  pinned: a range handed to a sink (`ranges`) keeps its block's file open until `unpin`, so a file
  descriptor is never closed under a `sendfile` that has not run yet.
- `ranges` never waits: a block not in hand yet (still being fetched) gives None, and the sink reads
  those bytes with `pread`, which waits for the block. `want` schedules blocks on the stream's fetch
  pool, so by the time a sink reaches them they are usually in hand.
- Every byte read from a block that was cached before this stream asked for it counts as a cache hit.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, Future
from typing import TYPE_CHECKING, Any

from reshard.io.source.store_cache import Block, Fetch, StoreCache
from reshard.plan.reads import runs_array

if TYPE_CHECKING:
    import numpy as np

OPEN = 32  # blocks held open per object (plus the pinned ones)

Submit = Callable[..., "Future[Any]"]
BytesAt = tuple[int, int] | Callable[[], "tuple[int, int] | None"]  # (fd, offset), or a wait for it


class CachedObject:
    """One object of one stream, read from the cache's blocks (see the module docstring)."""

    def __init__(self, cache: StoreCache, fetch: Fetch, url: str, version: str,
                 size: int) -> None:
        self.cache, self.fetch, self.url, self.version, self.size = cache, fetch, url, version, size
        self.block = cache.block
        self._open: OrderedDict[int, Block] = OrderedDict()
        self._wanted: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self._closed = False

    # --- blocks in hand ---------------------------------------------------------------------------

    def want(self, lo: int, hi: int, submit: Submit) -> int:
        """Have the blocks behind bytes [lo, hi) fetched ahead (`submit(fn, k)` runs `fn(k)` in a pool);
        the bytes of the blocks newly asked for."""
        asked = 0
        for k in range(lo // self.block, (hi - 1) // self.block + 1):
            with self._lock:
                if self._closed or k in self._open or k in self._wanted:
                    continue
                self._wanted[k] = submit(self._land, k)
            asked += self._length(k)
        return asked

    def _length(self, k: int) -> int:
        return min((k + 1) * self.block, self.size) - k * self.block

    def _land(self, k: int, *, pin: bool = False) -> Block | None:
        """Block k into hand (pinned, with `pin`); None if the object was closed meanwhile."""
        blk = self.cache.open_block(self.fetch, self.url, self.version, self.size, k)
        with self._lock:
            if self._closed:
                blk.close()
                return None
            if k in self._open:  # another thread landed it meanwhile
                blk.close()
                return self._held(k) if pin else None
            self._open[k] = blk
            blk.pins += pin
            self._trim()
            return blk

    def _held(self, k: int) -> Block | None:
        """Block k pinned, if in hand (lock held)."""
        blk = self._open.get(k)
        if blk is not None:
            blk.pins += 1
            self._open.move_to_end(k)
        return blk

    def _pinned(self, k: int, *, wait: bool) -> Block | None:
        """Block k pinned (release it with `_release`): if in hand; else, with `wait`, once its fetch
        (on the way, or made here) has landed it."""
        with self._lock:
            blk = self._held(k)
            if blk is not None or not wait:
                return blk
            fut = self._wanted.pop(k, None)
        if fut is not None:
            with contextlib.suppress(CancelledError):
                fut.result()  # raises what failed the fetch (a replaced object, say)
            with self._lock:
                blk = self._held(k)
        blk = blk or self._land(k, pin=True)
        if blk is None:
            raise ValueError(f"{self.url}: read after the stream closed")
        return blk

    def _release(self, blk: Block) -> None:
        with self._lock:
            blk.pins -= 1
            self._trim()

    @contextlib.contextmanager
    def _using(self, k: int) -> Iterator[Block]:
        """Block k for a read: pinned, so no landing block closes it under the read."""
        blk = self._pinned(k, wait=True)
        assert blk is not None
        try:
            yield blk
        finally:
            self._release(blk)

    def _trim(self) -> None:
        """Close the least recently used blocks past `OPEN` that no one uses now (lock held)."""
        excess = len(self._open) - OPEN
        for k in [k for k, b in self._open.items() if b.pins == 0][: max(excess, 0)]:
            self._open.pop(k).close()

    # --- reads ------------------------------------------------------------------------------------

    def ranges(self, offset: int, n: int, *, direct_min: int) -> Iterator[tuple[int, BytesAt | None]]:
        """Bytes [offset, offset + n) as consecutive parts (length, source) without waiting: where a part
        is at least `direct_min` bytes, `source` is (fd, offset) of its block file, pinned until
        `unpin(source)`, or, while the block is still on its way, a function that waits for it and
        returns that (call it off the event loop); else None (read those bytes with `pread`)."""
        end = offset + n
        while offset < end:
            k = offset // self.block
            m = min((k + 1) * self.block, end) - offset
            src: BytesAt | None = None
            if m >= direct_min:
                src = self._take(k, offset, m, wait=False) or functools.partial(self._take, k, offset, m, wait=True)
            yield m, src
            offset += m

    def _take(self, k: int, offset: int, m: int, *, wait: bool) -> tuple[int, int] | None:
        """(fd, offset) in block k's file for the m bytes at `offset`, the block pinned; None if it is
        not in hand and not `wait`, or it could not be kept on disk (then the bytes are read instead)."""
        blk = self._pinned(k, wait=wait)
        if blk is None:
            return None
        if blk.fd is None:
            self._release(blk)
            return None
        if blk.hit:
            self.cache.hit(m)
        return blk.fd, offset - k * self.block

    def unpin(self, src: tuple[int, int]) -> None:
        """The sink is done with a source `ranges` gave."""
        with self._lock:
            blk = next(b for b in self._open.values() if b.fd == src[0])  # pinned: still open
        self._release(blk)

    def pread(self, dst: memoryview, offset: int) -> None:
        done = 0
        while done < len(dst):
            k = (offset + done) // self.block
            at = offset + done - k * self.block
            m = min(self._length(k) - at, len(dst) - done)
            with self._using(k) as blk:
                blk.read_into(dst[done : done + m], at)
            if blk.hit:
                self.cache.hit(m)
            done += m

    def gather(self, out: np.ndarray, offset: int, run: int, stride: int, count: int) -> None:
        """The `count` runs of `run` bytes `stride` apart from `offset` into `out` (their `runs_array`):
        the runs inside one block in one copy from its mapping, a run across two blocks by `pread`."""
        import numpy as np

        i = 0
        while i < count:
            start = offset + i * stride
            k = start // self.block
            room = k * self.block + self._length(k) - start - run  # bytes of block k after this run
            inside = (room // stride + 1 if stride > 0 else count) if room >= 0 else 0  # runs that end in it
            if inside > 0:
                j = min(count, i + inside)
                with self._using(k) as blk:
                    out[i:j] = runs_array(blk.view(), start - k * self.block, run, stride, j - i)
                if blk.hit:
                    self.cache.hit((j - i) * run)
                i = j
                continue
            tmp = bytearray(run)
            self.pread(memoryview(tmp), start)
            out[i : i + 1] = np.frombuffer(tmp, f"V{run}")
            i += 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            wanted, self._wanted = self._wanted, {}
            blocks, self._open = list(self._open.values()), OrderedDict()
        for fut in wanted.values():
            fut.cancel()
        for blk in blocks:
            blk.close()


__all__ = ["OPEN", "CachedObject"]
