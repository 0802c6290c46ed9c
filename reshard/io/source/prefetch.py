"""A store-backed stream's reads, fetched ahead: the `Prefetcher`.

The stream's output is cut into windows; for each window the ranges the stream reads are listed
(`reshard.plan.reads.piece_reads`, the same the local stream preads) and fetched by a shared pool
(several requests in flight) while at most `cap` bytes are fetched or in flight ahead of the reader.

- Through the node's store cache (the service's, `reshard.io.source.store_cache`): the blocks behind each
  window are fetched ahead into the cache (`reshard.io.source.cached_object`); the stream then reads them as files.
- Otherwise the ranges themselves, into memory: ranges of one file that touch are merged, and so are
  ranges a short gap apart while the gaps stay within `store_waste` of the bytes read (shortest gaps
  first, the budget carried from window to window). A row-split tensor's short rows are fetched as
  the row block that covers them or as each row's slice (in requests of several ranges where the
  server answers them: `reshard.io.source.multirange`), whichever `reshard.io.source.readcost` prices lower.
"""

from __future__ import annotations

import bisect
import contextlib
import signal
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from reshard.plan.reads import piece_reads
from reshard.settings import library_settings

if TYPE_CHECKING:
    from reshard.io.source.readers import RemoteReader

WINDOW = 8 << 20  # output bytes planned (and fetched) together
# Bytes fetched ahead of the reader (`store_inflight`) and requests in flight (`store_concurrency`)
# come from `reshard.settings`. Merging two ranges across a gap saves a request and costs the gap's
# bytes: the gaps merged (each at most `store_max_gap`) add at most `store_waste` of the bytes a stream
# reads (its budget carries over from window to window, shortest gaps first); on a store with a high
# cost per request, raise both (neighbouring tensors then come together).


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


def pool() -> ThreadPoolExecutor:
    """The fetch pool of the process, made with its first thread running and registered. Made with
    SIGINT/SIGTERM held back: an interrupt (which the CLI raises from its handler) landing between
    the start of a pool's first thread and its registration would leave a thread that nothing tells
    to stop, and the interpreter would wait for it at exit forever."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            with _signals_held():
                p = ThreadPoolExecutor(library_settings().store_concurrency, thread_name_prefix="reshard-fetch")
                p.submit(int).result()
                _POOL = p
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


class _Span:
    """A row-split read's span, its rows' slices filled in by requests for several ranges (quacks like
    the Future of a single range)."""

    def __init__(self, start: int, n: int) -> None:
        self.start, self.view = start, memoryview(bytearray(n))
        self.futs: list[Future[list[memoryview]]] = []

    def result(self) -> memoryview:
        for fut in self.futs:
            fut.result()
        return self.view

    def cancel(self) -> bool:
        return all([fut.cancel() for fut in self.futs])


@dataclass
class _Window:
    start: int
    end: int
    nbytes: int
    ranges: dict[str, list[tuple[int, int, Future[memoryview] | _Part | _Span]]] = field(default_factory=dict)


class Prefetcher:
    """Fetches ahead the source ranges of a stream's next windows; `copy` serves reads from them. Its
    readers are the remote readers built with it (`RemoteReader(..., fetch_ahead=)` calls `add`)."""

    def __init__(self, starts: list[int], pieces: list[Any], size: int, *,
                 window: int | None = None, cap: int | None = None) -> None:
        self.starts, self.pieces, self.size = starts, pieces, size
        self.readers: dict[str, RemoteReader] = {}
        settings = library_settings()
        self.window, self.cap = window or WINDOW, cap or settings.store_inflight
        self.max_gap, self.waste = settings.store_max_gap, settings.store_waste
        self.range_gap = settings.store_range_gap
        self.settings = settings
        self.windows: deque[_Window] = deque()
        self.next = 0  # output offset the next window starts at
        self.buffered = 0
        self.spare = 0  # gap bytes the stream may still fetch to save requests
        self._lock = threading.Lock()  # the reader thread plans, the sink's thread drops what it sent

    def add(self, reader: RemoteReader) -> None:
        """Fetch ahead `reader`'s ranges of the stream too (before the stream reads anything)."""
        self.readers[reader.path] = reader

    def ensure(self, lo: int, hi: int) -> None:
        """Before the stream reads bytes [lo, hi): drop windows behind, plan and fetch ahead."""
        with self._lock:
            if not self.windows or lo < self.windows[0].start or lo > self.next:
                self._cancel()
                self.next = lo
            self._behind(lo)
            self._ahead(hi)

    def ahead(self, lo: int, hi: int) -> None:
        """The stream is at byte `lo`: plan and fetch the windows up to byte `hi`, and beyond it while
        within the cap (windows behind are dropped by `behind`)."""
        with self._lock:
            if lo > self.next:
                self._cancel()
                self.next = lo
            self._ahead(hi)

    def behind(self, pos: int) -> None:
        """The stream is done with the bytes before `pos`: drop the windows that end there."""
        with self._lock:
            self._behind(pos)

    def _ahead(self, hi: int) -> None:
        while self.next < self.size and (self.next < hi or self.buffered < self.cap):
            self._plan(self.next, min(self.next + self.window, self.size))

    def _behind(self, pos: int) -> None:
        while self.windows and self.windows[0].end <= pos:
            self._drop(self.windows.popleft())

    def _plan(self, lo: int, hi: int) -> None:
        runs: list[tuple[str, int, int]] = []
        spans: list[tuple[int, int, list[tuple[str, int, int]]]] = []  # rows' slices into their span's buffer
        w = _Window(lo, hi, 0)
        i = bisect.bisect_right(self.starts, lo) - 1
        while i < len(self.pieces) and self.starts[i] < hi:
            piece, base = self.pieces[i], self.starts[i]
            if not isinstance(piece, bytes):
                for rd in piece_reads(piece, max(lo - base, 0), min(hi - base, piece.nbytes)):
                    reader = self.readers.get(rd.file)
                    if reader is None:
                        continue
                    if reader.blocks is not None:  # into the cache: the blocks behind the span
                        w.nbytes += reader.blocks.want(rd.offset, rd.offset + rd.span, pool().submit)
                    elif rd.count > 1 and reader.store.costs.slices(rd.run, rd.stride, rd.count, reader.multi and reader.multi.most,
                                                              self.settings):  # the rows' slices, not their row block
                        rows = [(rd.file, rd.offset + k * rd.stride, rd.run) for k in range(rd.count)]
                        if reader.multi is not None:
                            spans.append((rd.offset, rd.span, rows))
                        else:
                            runs.extend(rows)
                    else:
                        runs.append((rd.file, rd.offset, rd.span))
            i += 1
        self._fetch(w, runs)
        self._fetch_spans(w, spans)
        for ranges in w.ranges.values():
            ranges.sort(key=lambda r: r[0])
        self.windows.append(w)
        self.buffered += w.nbytes
        self.next = hi

    def _fetch(self, w: _Window, runs: list[tuple[str, int, int]]) -> None:
        """Submit the window's ranges: merged across short gaps, one range per request, or several."""
        single = [r for r in runs if self.readers[r[0]].multi is None]
        ranges, self.spare = coalesce(single, self.spare + int(self.waste * sum(n for _, _, n in single)), self.max_gap)
        for f, off, n in ranges:
            w.ranges.setdefault(f, []).append((off, off + n, pool().submit(self.readers[f].fetch, off, off + n)))
            w.nbytes += n
        several, _ = coalesce([r for r in runs if self.readers[r[0]].multi is not None], 0, self.range_gap, spend=False)
        most = {f: r.multi.most for f, r in self.readers.items() if r.multi is not None}
        for f, group in _requests(several, most):
            fut = pool().submit(self.readers[f].fetch_ranges, group)
            w.ranges.setdefault(f, []).extend((a, b, _Part(fut, k)) for k, (a, b) in enumerate(group))
            w.nbytes += sum(b - a for a, b in group)

    def _fetch_spans(self, w: _Window, spans: list[tuple[int, int, list[tuple[str, int, int]]]]) -> None:
        """Submit the rows' slices of row-split reads as the ranges of requests for several (up to the
        server's most each, across reads), each slice copied into a buffer as long as the read's span:
        the stream gathers the runs from it as from a row block."""
        parts: list[tuple[str, int, int, _Span]] = []
        for off, n, rows in spans:
            span = _Span(off, n)
            ranges, _ = coalesce(rows, 0, self.range_gap, spend=False)
            parts.extend((f, a, m, span) for f, a, m in ranges)
            w.ranges.setdefault(rows[0][0], []).append((off, off + n, span))
            w.nbytes += n
        for f, group in _requests([(f, a, m) for f, a, m, _ in parts], {f: r.multi.most for f, r in self.readers.items()
                                                                      if r.multi is not None}):
            dests, owners = [], []
            for (a, b), (_, _, _, span) in zip(group, parts[: len(group)]):
                dests.append(span.view[a - span.start : b - span.start])
                owners.append(span)
            del parts[: len(group)]
            fut = pool().submit(self.readers[f].fetch_ranges, group, dests)
            for span in {id(o): o for o in owners}.values():
                span.futs.append(fut)

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

    def _find(self, path: str, pos: int) -> tuple[int, int, Future[memoryview] | _Part | _Span] | None:
        with self._lock:  # the sink's thread may drop windows meanwhile
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
        with self._lock:
            self._cancel()

    def _cancel(self) -> None:
        while self.windows:
            self._drop(self.windows.popleft())


__all__ = ["WINDOW", "Prefetcher", "coalesce", "pool"]
