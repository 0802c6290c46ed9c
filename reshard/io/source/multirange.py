"""Several byte ranges of one object in one HTTP request, where the server answers them.

    client = client_for(store, key, size, version)   # None: not HTTP(S), or the server answers one range only
    parts = client.get(key, [(0, 512), (4096, 4608)], version)   # memoryviews, in the order asked

`Range: bytes=a-b,c-d,...` is answered by static HTTP servers (nginx, Caddy, Starlette's
FileResponse) with one `multipart/byteranges` body: each part its own `Content-Range`. Object stores
(S3, GCS) answer one range per request. So where a server answers them, a row-split tensor's slices
can come exactly, as ranges of one request (at tp=8 a rank's slice of a 4 KiB row is 512 bytes, 7/8 of
the row block a single range would cost), instead of as the row block that covers them
(`reshard.io.source.readcost` says which costs less). Whether a server answers them, how many in one body,
and what a request and a range cost it are asked once per store root (`probe`: a few HEAD and GET
requests for 1-byte ranges of the first object read).

A server that refuses that many ranges (400, 413, 431: Starlette takes 100, a header line longer than
nginx's 8 KiB buffer) is asked for half as many. The answer's ETag must be the planned version (a replaced object fails the stream), the parts must
cover every range asked for (a server may merge neighbouring ranges into one part), and a server that
answers the whole object (200) is not asked again. Timeouts, dropped connections and 5xx answers are
retried with backoff, like the store client's (`RESHARD_STORE_RETRIES`, `RESHARD_STORE_TIMEOUT`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx

from reshard.errors import CheckpointError, SourceChangedError, StoreError, StoreUnavailableError
from reshard.io.retry import Retries, Retryable
from reshard.io.source.stores import count_fetched, store_backoff
from reshard.settings import library_settings

if TYPE_CHECKING:
    from reshard.io.source.readcost import Costs

PROBE = 16  # ranges of the requests that time a range
_BOUNDARY = re.compile(r"boundary=\"?([^\";]+)\"?", re.I)


class Unanswered(Exception):
    """The server did not answer several ranges in one body: ask it one range per request."""


class MultiRangeClient:
    """A connection pool to one HTTP(S) store root (`http://HOST:PORT`)."""

    def __init__(self, root: str, costs: Costs) -> None:
        settings = library_settings()
        self.root, self.retries, self.costs = root.rstrip("/"), settings.store_retries, costs
        self._http = httpx.Client(timeout=httpx.Timeout(settings.store_timeout, connect=10.0), follow_redirects=True,
                                  limits=httpx.Limits(max_connections=settings.store_concurrency))
        self.most = settings.store_ranges  # ranges per request; lowered where the server answers fewer

    def get(self, key: str, ranges: list[tuple[int, int]], version: str) -> list[memoryview]:
        """Bytes [a, b) of object `key` for each (a, b) of `ranges` (ascending, disjoint)."""
        return list(_slices(self._retried(key, ranges, version), ranges, f"{self.root}/{key}"))

    def get_into(self, key: str, ranges: list[tuple[int, int]], version: str, dests: list[memoryview]) -> None:
        """The same, each range's bytes copied into its destination (as long as the range)."""
        for dst, data in zip(dests, _slices(self._retried(key, ranges, version), ranges, f"{self.root}/{key}")):
            dst[:] = data

    def _retried(self, key: str, ranges: list[tuple[int, int]], version: str) -> list[tuple[int, memoryview]]:
        def once() -> list[tuple[int, memoryview]]:
            with self.costs.timed(len(ranges)) as got:
                parts = self._get(key, ranges, version)
                got.append(sum(len(d) for _, d in parts))
            return parts

        tries = Retries(store_backoff(self.retries), give_up=lambda e: StoreUnavailableError(
            f"{self.root}/{key}: {len(ranges)} ranges failed after {self.retries} retries ({e})"))
        return tries.call(once, retry_on=(httpx.TransportError, Retryable))

    def _get(self, key: str, ranges: list[tuple[int, int]], version: str) -> list[tuple[int, memoryview]]:
        url = f"{self.root}/{key}"
        spec = ",".join(f"{a}-{b - 1}" for a, b in ranges)
        with self._http.stream("GET", url, headers={"Range": f"bytes={spec}", "Accept-Encoding": "identity"}) as r:
            if r.status_code >= 500:
                raise Retryable(f"HTTP {r.status_code}")
            if r.status_code == 404:
                raise CheckpointError(f"{url}: no such object")
            several = len(ranges) > 1
            if r.status_code in (200, 416) or (several and r.status_code in (400, 413, 431)) or (
                    r.status_code == 206 and several and "multipart/byteranges" not in r.headers.get("content-type", "")):
                raise Unanswered(f"{url}: HTTP {r.status_code} {r.headers.get('content-type')}")  # not read
            if r.status_code != 206:
                raise StoreError(f"{url}: the server answered {r.status_code} to a ranged GET")
            etag = r.headers.get("etag")
            if etag != version:
                raise SourceChangedError(f"{url}: replaced while being read (ETag {etag}, planned {version}); "
                                         "re-plan and retry")
            raw = r.read()
            count_fetched(len(raw))
            if "multipart/byteranges" in r.headers.get("content-type", ""):
                return _parts(raw, r.headers, ranges)
            return [(ranges[0][0], memoryview(raw))]

    def probe(self, key: str, size: int, version: str) -> None:
        """Whether the server answers several ranges in one body (else `Unanswered`), how many (halved
        from `most` until it does: asked with HEAD where its HEAD honours Range, else with GET), and
        what a request and a range cost it (three GETs of each kind, recorded in `costs`)."""
        spots = [(2 * i, 2 * i + 1) for i in range(min(self.most, max(size // 2, 2)))]
        head = self._answers(key, spots[:2])  # else HEAD tells nothing: ask with GET (a refusal costs a body)
        self.get(key, spots[:2], version)
        n = len(spots)
        while n > 2:
            try:
                if self._answers(key, spots[:n]) if head else bool(self.get(key, spots[:n], version)):
                    break
            except Unanswered:
                pass
            n //= 2
        self.most = n
        for _ in range(3):  # PROBE ranges: the cost per range shows, their part headers stay a few KiB
            self.get(key, spots[:1], version)
            self.get(key, spots[: min(n, PROBE)], version)

    def _answers(self, key: str, ranges: list[tuple[int, int]]) -> bool:
        spec = ",".join(f"{a}-{b - 1}" for a, b in ranges)
        r = self._http.head(f"{self.root}/{key}", headers={"Range": f"bytes={spec}"})
        return r.status_code == 206 and "multipart/byteranges" in r.headers.get("content-type", "")




def _parts(raw: bytes, headers: httpx.Headers, ranges: list[tuple[int, int]]) -> list[tuple[int, memoryview]]:
    """(first byte, bytes) of each part of a multipart/byteranges body. Each part's head is matched
    where the previous part's bytes end: first as the previous head with the next range asked for in
    it (servers write every head alike, one part per range, in order: one comparison), else by a regex."""
    m = _BOUNDARY.search(headers.get("content-type", ""))
    if m is None:
        raise StoreError("a multipart/byteranges answer without a boundary")
    delim = re.escape(b"--" + m.group(1).encode("latin-1"))
    head = re.compile(rb"(?:\r\n)*" + delim + rb"(--)?[ \t]*\r\n(?:(?:[^\r\n]*\r\n)*?content-range:[ \t]*bytes[ \t]+"
                      rb"(\d+)-(\d+)/[^\r\n]*\r\n(?:[^\r\n]*\r\n)*?\r\n)?", re.I)
    body, parts, pos = memoryview(raw), [], 0
    around: tuple[bytes, bytes] | None = None  # a head without its range: what comes before and after
    while True:
        if around is not None and len(parts) < len(ranges):
            a, b = ranges[len(parts)]
            expect = b"%s%d-%d%s" % (around[0], a, b - 1, around[1])
            if raw.startswith(expect, pos):
                parts.append((a, body[pos + len(expect) : pos + len(expect) + b - a]))
                pos += len(expect) + b - a
                continue
        h = head.match(raw, pos)
        if h is None or h.group(1):  # the end (the closing delimiter, or no more parts)
            return parts
        if h.group(2) is None:
            raise StoreError("a part of a multipart/byteranges answer without its Content-Range")
        first, last = int(h.group(2)), int(h.group(3))
        text, numbers = raw[h.start(2) - 1 : h.end()], b" %d-%d/" % (first, last)
        if text.startswith(numbers) and raw[pos : h.start(2) - 1].startswith(b"\r\n"):  # not the first part
            around = (raw[pos : h.start(2) - 1] + b" ", text[len(numbers) - 1 :])
        parts.append((first, body[h.end() : h.end() + last - first + 1]))
        pos = h.end() + last - first + 1


def _slices(parts: list[tuple[int, memoryview]], ranges: list[tuple[int, int]], url: str) -> Iterator[memoryview]:
    """The bytes of each range (ascending) from the parts that hold them (in one pass: servers answer in
    order, one part per range or several ranges merged into one)."""
    parts = sorted(parts, key=lambda p: p[0])
    j = 0
    for a, b in ranges:
        while j < len(parts) and parts[j][0] + len(parts[j][1]) < b:
            j += 1
        if j == len(parts) or parts[j][0] > a:
            raise StoreError(f"{url}: the server's answer lacks bytes {a}-{b - 1}")
        first, data = parts[j]
        yield data[a - first : b - first]


_CLIENTS: dict[str, MultiRangeClient | None] = {}
_LOCK = threading.Lock()


def client_for(store: Any, key: str, size: int, version: str) -> MultiRangeClient | None:
    """The multi-range client of `store`'s root where it is HTTP(S) and answers several ranges in one
    body (asked once per root, of `key`: `MultiRangeClient.probe`), else None."""
    if not store.root.lower().startswith(("http://", "https://")) or not version or version.startswith(
            ("mtime:", "version:")) or not library_settings().store_multirange:
        return None
    with _LOCK:
        if store.root in _CLIENTS:
            return _CLIENTS[store.root]
        client: MultiRangeClient | None = MultiRangeClient(store.root, store.costs)
        assert client is not None
        try:
            client.probe(key, size, version)
        except (Unanswered, StoreError, CheckpointError, SourceChangedError, httpx.HTTPError):
            client = None  # one range per request; a real failure is met again by the stream's own reads
        _CLIENTS[store.root] = client
        return client


__all__ = ["MultiRangeClient", "Unanswered", "client_for"]
