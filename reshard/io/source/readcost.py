"""What a store charges for a read, and so how to read a row-split tensor's rows from it.

A rank of a row-split tensor needs a slice of every row (at tp=8, an eighth of each). There are three
ways to fetch them, and which is cheapest depends on the store:

- the row block: one range covering the rows (few requests, up to tp times the bytes);
- each row's slice as its own range, a request each (S3, GCS answer one range per request): the
  bytes exactly, a request per row. Between two slices the block costs the gap's bytes and saves a
  request, so this is the block wherever the gap is shorter than `request_s * bandwidth`: row slices
  are coalesced up to that measured gap;
- the slices as the ranges of requests for several (`reshard.io.source.multirange`, where the server
  answers multipart/byteranges): the bytes exactly plus ~100 bytes of part headers each, a request per
  `most` ranges, and whatever the server spends per part (`range_s`: about 2 us for nginx, 0.1 ms
  and more for a Python file server).

`Costs` prices a read as  requests * request_s + ranges * range_s + bytes / bandwidth  (the seconds a
request adds to a stream that keeps `store_concurrency` of them in flight) and `Costs.slices` says,
for one read of `count` rows, whether the slices cost less than the block. The figures are
measured per store root from the process's own requests (`record`, the first quartile of recent
ones; the defaults below until there are some), or set: `RESHARD_STORE_REQUEST_COST` (seconds) and
`RESHARD_STORE_BANDWIDTH` (bytes/s: the link a node has to the store, which a loopback benchmark
cannot show), and `RESHARD_STORE_ROWS=blocks|slices` skips the pricing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from reshard.settings import LibrarySettings

PART_HEADER = 100  # bytes of headers per part of a multipart/byteranges answer
SMALL, LARGE = 256 << 10, 1 << 20  # requests up to SMALL show the cost per request, from LARGE the bandwidth
KEEP = 64  # recent requests each estimate is the median of
# until the process has measured its own: an object store answers in ~10-30 ms, a static server on a
# LAN in ~1 ms; a connection moves ~100 MB/s
DEFAULT_REQUEST_S = {"s3": 0.02, "gs": 0.02, "http": 0.002, "https": 0.002, "hf": 0.02}
DEFAULT_RANGE_S = 20e-6
DEFAULT_BANDWIDTH = 100e6


@dataclass(frozen=True)
class Price:
    request_s: float  # seconds per request
    range_s: float  # seconds per range of a request for several
    bandwidth: float  # bytes per second

    def of(self, requests: float, ranges: int, nbytes: int) -> float:
        return requests * self.request_s + ranges * self.range_s + nbytes / self.bandwidth


class Costs:
    """The measured cost of one store root's requests (one per root and process: `costs_for`). A
    request's seconds are divided by the requests in flight with it: with 16 in flight each takes about
    16 times its share of the stream's time."""

    def __init__(self, scheme: str) -> None:
        self.scheme = scheme
        self._small: deque[tuple[float, int]] = deque(maxlen=KEEP)  # (seconds, bytes) of short requests
        self._rate: deque[tuple[float, int]] = deque(maxlen=KEEP)  # (seconds, bytes) of long ones
        self._per_range: deque[tuple[float, int, int]] = deque(maxlen=KEEP)  # (seconds, bytes, ranges), several
        self._lock = threading.Lock()
        self.inflight = 0

    @contextlib.contextmanager
    def timed(self, ranges: int = 1) -> Iterator[list[int]]:
        """Time one request for `ranges` ranges; put its body's length in the list yielded (an error:
        nothing is recorded)."""
        got: list[int] = []
        with self._lock:
            self.inflight += 1
            before = self.inflight
        t0 = time.perf_counter()
        try:
            yield got
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                during = (before + self.inflight) / 2
                self.inflight -= 1
            if got:
                self.record(seconds / during, got[0], ranges)

    def record(self, seconds: float, nbytes: int, ranges: int = 1) -> None:
        """One request cost the stream `seconds` for `nbytes` of body in `ranges` ranges (kept as they
        are: each estimate nets the others out when it is made)."""
        with self._lock:
            if ranges == 1 and nbytes <= SMALL:
                self._small.append((seconds, nbytes))
            elif ranges == 1 and nbytes >= LARGE:
                self._rate.append((seconds, nbytes))
            elif ranges >= 8:
                self._per_range.append((seconds, nbytes, ranges))

    def _measured(self) -> Price:
        """Low quantiles of the recent requests (a loaded machine only ever adds time): the request cost
        of short ones less their bytes' time, the bandwidth of long ones less their request cost, the
        cost per range of those for several less both."""
        bandwidth, request_s = DEFAULT_BANDWIDTH, DEFAULT_REQUEST_S.get(self.scheme, 0.02)
        for _ in range(2):  # each estimate uses the other's
            if self._small:
                request_s = _low(max(t - n / bandwidth, 0.0) for t, n in self._small)
            if self._rate:
                bandwidth = -_low(-n / max(t - request_s, 1e-6) for t, n in self._rate)
        range_s = _low(max(t - request_s - n / bandwidth, 0.0) / r for t, n, r in self._per_range) \
            if self._per_range else DEFAULT_RANGE_S
        return Price(request_s, range_s, bandwidth)

    def price(self, settings: LibrarySettings | None = None) -> Price:
        """The figures now: the ones set (`settings`, else the environment's), else measured, else the defaults."""
        from reshard.settings import library_settings

        s = settings or library_settings()
        with self._lock:
            m = self._measured()
        return Price(s.store_request_cost or m.request_s, m.range_s, s.store_bandwidth or m.bandwidth)

    def slices(self, run: int, stride: int, count: int, most: int | None, settings: LibrarySettings) -> bool:
        """Whether `count` rows' slices of `run` bytes `stride` apart cost less than their row block:
        as the ranges of requests for up to `most` each where the server answers several (`most`), else
        one request each. `settings.store_rows` (`RESHARD_STORE_ROWS`) can decide instead."""
        if settings.store_rows != "auto":
            return settings.store_rows == "slices"
        price = self.price(settings)
        block = price.of(1, 0, (count - 1) * stride + run)
        if most:
            return price.of(count / most, count, count * (run + PART_HEADER)) < block
        return price.of(count, 0, count * run) < block


def _low(values: Iterable[float]) -> float:
    """The first quartile of `values`."""
    v = sorted(values)
    return v[len(v) // 4]


_COSTS: dict[str, Costs] = {}
_LOCK = threading.Lock()


def costs_for(root: str) -> Costs:
    """The costs of store root `root` (`s3://BUCKET`, `http://HOST:PORT`) in this process."""
    with _LOCK:
        if root not in _COSTS:
            _COSTS[root] = Costs(root.split("://", 1)[0].lower())
        return _COSTS[root]


__all__ = ["Costs", "Price", "costs_for"]
