"""How a `RankStream` reads its source files: `pread` on a local fd, or ranged GETs from a store.

`open_reader(path, key)` gives a `LocalReader` (the fd also serves kernel copies) or a
`RemoteReader`. Remote bytes are fetched ahead by a `Prefetcher`: the stream's output is cut into
windows; for each window the ranges the stream reads are listed (`reshard.plan.reads.piece_reads`, the
same the local stream preads) and fetched by a shared pool (several requests in flight) while at most
`cap` bytes are fetched or in flight ahead of the reader. How a row-split tensor's short rows are
fetched depends on the store:

- a server that answers several ranges per request (`reshard.io.multirange`: nginx, Caddy, static
  file servers): each row's slice exactly, ranges a short gap apart (`store_range_gap`) merged, up
  to `store_ranges` ranges per request;
- a store that answers one range per request (S3, GCS): the row block that covers them, one request
  for many rows (`store_row_blocks`; off: each row's slice on its own);
- through the node's store cache (`reshard.io.store_cache`, the service's): the row block, read
  from cached blocks.

Ranges of one file that touch are merged, and so are ranges a short gap apart while the gaps stay
within `store_waste` of the bytes read (shortest gaps first, the budget carried from window to window).
Each GET names the planned ETag: a replaced object fails the stream.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import signal
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from reshard.errors import SourceChangedError
from reshard.io import store_cache
from reshard.io.mapped import MAPS
from reshard.io.multirange import MultiRangeClient, Unanswered, client_for
from reshard.io.stores import is_url, store_for
from reshard.plan.reads import piece_reads
from reshard.settings import library_settings

if TYPE_CHECKING:
    import numpy as np

WINDOW = 8 << 20  # output bytes planned (and fetched) together
# Bytes fetched ahead of the reader (`store_inflight`) and requests in flight (`store_concurrency`)
# come from `reshard.settings`. Merging two ranges across a gap saves a request and costs the gap's
# bytes: the gaps merged (each at most `store_max_gap`) add at most `store_waste` of the bytes a stream
# reads (its budget carries over from window to window, shortest gaps first); on a store with a high
# cost per request, raise both (neighbouring tensors then come together).


class Reader(Protocol):
    """One source file of a stream; `fd` is set where the file is local (kernel copies)."""

    fd: int | None

    def pread(self, dst: memoryview, offset: int) -> None: ...

    def pread_runs(self, dst: memoryview, offset: int, run: int, stride: int, count: int) -> None:
        """The `count` runs of `run` bytes `stride` apart from `offset` into `dst` (the span that
        covers them); the bytes between runs are unspecified."""

    def gather(self, out: np.ndarray, offset: int, run: int, stride: int, count: int) -> bool:
        """The same runs straight into `out` (their `reshard.plan.reads.runs_array`) where the reader can (a leased
        mapping, `reshard.io.mapped`); False: use `pread_runs`."""

    def check(self) -> None:
        """Raise `SourceChangedError` if the file changed since it was planned."""

    def close(self) -> None: ...


class LocalReader:
    def __init__(self, path: str, key: Sequence[Any]) -> None:
        self.path, self.key = path, tuple(key)
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY)
        except OSError as e:
            raise SourceChangedError(f"{e.filename}: cannot open source: {e.strerror}") from None
        try:
            st = os.fstat(self.fd)
            if (st.st_size, st.st_mtime_ns) != self.key:
                raise SourceChangedError(f"{path}: changed since it was planned (size {st.st_size}, planned {self.key[0]}); re-plan")
            self.ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)  # the file as opened
        except BaseException:
            self.close()
            raise

    def pread(self, dst: memoryview, offset: int) -> None:
        assert self.fd is not None
        got = 0
        while got < len(dst):
            n = os.preadv(self.fd, [dst[got:]], offset + got)
            if n <= 0:
                raise SourceChangedError(f"{self.path}: ended at byte {offset + got}, before the planned data; re-plan")
            got += n

    def pread_runs(self, dst: memoryview, offset: int, run: int, stride: int, count: int) -> None:
        self.pread(dst, offset)  # one read of the span: the page cache makes the gaps cheap

    def gather(self, out: np.ndarray, offset: int, run: int, stride: int, count: int) -> bool:
        assert self.fd is not None
        return MAPS.gather(self.fd, self.ident, out, offset, run, stride, count)

    def check(self) -> None:
        assert self.fd is not None
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != self.key:
            raise SourceChangedError(f"{self.path}: changed while being read; re-plan and retry")

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class RemoteReader:
    """An object in a store, read through the stream's `Prefetcher` (direct GETs for anything it
    did not fetch ahead)."""

    fd = None

    def __init__(self, path: str, key: Sequence[Any]) -> None:
        self.path = path
        self.size, self.version = int(key[0]), str(key[1])
        self.store, self.key = store_for(path)
        self.prefetcher: Prefetcher | None = None
        self.multi: MultiRangeClient | None = None  # set by the Prefetcher where the server answers several ranges

    def fetch_ranges(self, ranges: list[tuple[int, int]]) -> list[memoryview]:
        """Bytes [a, b) for each (a, b) of `ranges`: in one request where the server answers several
        (`reshard.io.multirange`), else one GET each."""
        if self.multi is not None:
            try:
                return self.multi.get(self.key, ranges, self.version)
            except Unanswered:  # too many ranges for this server (Starlette: 100, Apache: 200): ask half as many
                if len(ranges) > 2:
                    self.multi.most = min(self.multi.most, len(ranges) // 2)
                    half = len(ranges) // 2
                    return self.fetch_ranges(ranges[:half]) + self.fetch_ranges(ranges[half:])
                self.multi = None
        return [self._get(a, b) for a, b in ranges]

    def fetch(self, start: int, end: int) -> memoryview:
        """Bytes [start, end) of the object: through the node's block cache where one is on
        (`reshard.io.store_cache`: the service turns it on), else one conditional GET."""
        cache = store_cache.current()
        if cache is not None:
            return cache.read(self._get, self.path, self.version, self.size, start, end)
        return self._get(start, end)

    def _get(self, start: int, end: int) -> memoryview:
        data, _ = self.store.get(self.key, start, end, version=self.version)
        if len(data) != end - start:
            raise SourceChangedError(f"{self.path}: {len(data)} bytes at {start}, planned {end - start}; re-plan")
        return data

    def pread(self, dst: memoryview, offset: int) -> None:
        if self.prefetcher is None or not self.prefetcher.copy(self.path, offset, dst):
            dst[:] = self.fetch(offset, offset + len(dst))

    def pread_runs(self, dst: memoryview, offset: int, run: int, stride: int, count: int) -> None:
        if self.prefetcher is not None and self.prefetcher.copy(self.path, offset, dst):
            return  # the span was fetched ahead as one row block
        for i in range(count):
            self.pread(dst[i * stride : i * stride + run], offset + i * stride)

    def gather(self, out: np.ndarray, offset: int, run: int, stride: int, count: int) -> bool:
        return False

    def check(self) -> None:
        pass  # every GET is conditional on the planned ETag

    def close(self) -> None:
        pass


def open_reader(path: str, key: Sequence[Any]) -> Reader:
    return RemoteReader(path, key) if is_url(path) else LocalReader(path, key)


# --- prefetching -----------------------------------------------------------------------------------


def coalesce(runs: list[tuple[str, int, int]], budget: int, max_gap: int, *,
             spend: bool = True) -> tuple[list[tuple[str, int, int]], int]:
    """Merge runs of one file that touch or overlap; then close the shortest gaps (at most `max_gap`
    each) while their bytes fit `budget` (every such gap, without `spend`). Returns the ranges and the
    budget left."""
    ranges: list[list[Any]] = []
    for f, off, n in sorted(runs):
        if ranges and ranges[-1][0] == f and off <= ranges[-1][1] + ranges[-1][2]:
            ranges[-1][2] = max(ranges[-1][2], off + n - ranges[-1][1])
        else:
            ranges.append([f, off, n])
    gaps = sorted((b[1] - a[1] - a[2], i) for i, (a, b) in enumerate(zip(ranges, ranges[1:]))
                  if a[0] == b[0] and b[1] - a[1] - a[2] <= max_gap)
    close = set()
    for gap, i in gaps:
        if spend and gap > budget:
            break
        budget -= gap if spend else 0
        close.add(i)
    out: list[tuple[str, int, int]] = []
    for i, (f, off, n) in enumerate(ranges):
        if i - 1 in close:
            pf, po, _ = out[-1]
            out[-1] = (pf, po, off + n - po)
        else:
            out.append((f, off, n))
    return out, budget


def _requests(ranges: list[tuple[str, int, int]], most: dict[str, int]) -> Iterator[tuple[str, list[tuple[int, int]]]]:
    """(file, at most `most[file]` ranges (start, end)) per request: ranges of one file, in order."""
    group: list[tuple[int, int]] = []
    for i, (f, off, n) in enumerate(ranges):
        group.append((off, off + n))
        if len(group) >= most[f] or i + 1 == len(ranges) or ranges[i + 1][0] != f:
            yield f, group
            group = []


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    """The fetch pool of the process, made with its first thread running and registered. Made with
    SIGINT/SIGTERM held back: an interrupt (which the CLI raises from its handler) landing between
    the start of a pool's first thread and its registration would leave a thread that nothing tells
    to stop, and the interpreter would wait for it at exit forever."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            with _signals_held():
                pool = ThreadPoolExecutor(library_settings().store_concurrency, thread_name_prefix="reshard-fetch")
                pool.submit(int).result()
                _POOL = pool
        return _POOL


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM blocked in this thread for the block, delivered when it ends (where the
    platform lets a thread block signals)."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Part:
    """Range `i` of a request for several ranges (quacks like the Future of a single range)."""

    def __init__(self, fut: Future[list[memoryview]], i: int) -> None:
        self.fut, self.i = fut, i

    def result(self) -> memoryview:
        return self.fut.result()[self.i]

    def cancel(self) -> bool:
        return self.fut.cancel()


@dataclass
class _Window:
    start: int
    end: int
    nbytes: int
    ranges: dict[str, list[tuple[int, int, Future[memoryview] | _Part]]] = field(default_factory=dict)


class Prefetcher:
    """Fetches ahead the source ranges of a stream's next windows; `copy` serves reads from them."""

    def __init__(self, starts: list[int], pieces: list[Any], size: int, readers: dict[str, RemoteReader], *,
                 window: int | None = None, cap: int | None = None) -> None:
        self.starts, self.pieces, self.size, self.readers = starts, pieces, size, readers
        settings = library_settings()
        self.window, self.cap = window or WINDOW, cap or settings.store_inflight
        self.max_gap, self.waste = settings.store_max_gap, settings.store_waste
        self.range_gap = settings.store_range_gap
        cached = store_cache.current() is not None  # the cache fetches whole blocks: spans are what it reads
        for r in readers.values():
            r.multi = None if cached else client_for(r.store, r.key, r.version)
        # row-split tensors as their rows' slices (not row blocks) from these files
        self.exact = {f for f, r in readers.items() if r.multi is not None or not (cached or settings.store_row_blocks)}
        self.windows: deque[_Window] = deque()
        self.next = 0  # output offset the next window starts at
        self.buffered = 0
        self.spare = 0  # gap bytes the stream may still fetch to save requests
        for r in readers.values():
            r.prefetcher = self

    def ensure(self, lo: int, hi: int) -> None:
        """Before the stream reads bytes [lo, hi): drop windows behind, plan and fetch ahead."""
        if not self.windows or lo < self.windows[0].start or lo > self.next:
            self.cancel()
            self.next = lo
        while self.windows and self.windows[0].end <= lo:
            self._drop(self.windows.popleft())
        while self.next < self.size and (self.next < hi or self.buffered < self.cap):
            self._plan(self.next, min(self.next + self.window, self.size))

    def _plan(self, lo: int, hi: int) -> None:
        runs: list[tuple[str, int, int]] = []
        i = bisect.bisect_right(self.starts, lo) - 1
        while i < len(self.pieces) and self.starts[i] < hi:
            piece, base = self.pieces[i], self.starts[i]
            if not isinstance(piece, bytes):
                for rd in piece_reads(piece, max(lo - base, 0), min(hi - base, piece.nbytes)):
                    if rd.file not in self.readers:
                        continue
                    if rd.count > 1 and rd.file in self.exact:  # the rows' slices, not their row block
                        runs.extend((rd.file, rd.offset + k * rd.stride, rd.run) for k in range(rd.count))
                    else:
                        runs.append((rd.file, rd.offset, rd.span))
            i += 1
        w = _Window(lo, hi, 0)
        single = [r for r in runs if self.readers[r[0]].multi is None]
        ranges, self.spare = coalesce(single, self.spare + int(self.waste * sum(n for _, _, n in single)), self.max_gap)
        for f, off, n in ranges:
            w.ranges.setdefault(f, []).append((off, off + n, _pool().submit(self.readers[f].fetch, off, off + n)))
            w.nbytes += n
        several, _ = coalesce([r for r in runs if self.readers[r[0]].multi is not None], 0, self.range_gap, spend=False)
        for f, group in _requests(several, {f: r.multi.most for f, r in self.readers.items() if r.multi is not None}):
            fut = _pool().submit(self.readers[f].fetch_ranges, group)
            w.ranges.setdefault(f, []).extend((a, b, _Part(fut, k)) for k, (a, b) in enumerate(group))
            w.nbytes += sum(b - a for a, b in group)
        self.windows.append(w)
        self.buffered += w.nbytes
        self.next = hi

    def copy(self, path: str, offset: int, dst: memoryview) -> bool:
        """Fill dst with bytes [offset, offset+len(dst)) of `path` from fetched ranges; False if
        some byte was not fetched ahead (the caller reads it directly)."""
        pos, end = offset, offset + len(dst)
        while pos < end:
            hit = self._find(path, pos)
            if hit is None:
                return False
            a, b, fut = hit
            n = min(b, end) - pos
            dst[pos - offset : pos - offset + n] = fut.result()[pos - a : pos - a + n]
            pos += n
        return True

    def _find(self, path: str, pos: int) -> tuple[int, int, Future[memoryview]] | None:
        for w in self.windows:
            ranges = w.ranges.get(path)
            if not ranges:
                continue
            j = bisect.bisect_right(ranges, (pos, float("inf"))) - 1
            if j >= 0 and ranges[j][0] <= pos < ranges[j][1]:
                return ranges[j]
        return None

    def _drop(self, w: _Window) -> None:
        self.buffered -= w.nbytes
        for ranges in w.ranges.values():
            for _, _, fut in ranges:
                fut.cancel()

    def cancel(self) -> None:
        while self.windows:
            self._drop(self.windows.popleft())
