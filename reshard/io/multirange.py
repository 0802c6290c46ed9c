"""Several byte ranges of one object in one HTTP request, where the server answers them.

    client = client_for(store, key, version)      # None: not HTTP(S), or the server answers one range only
    parts = client.get(key, [(0, 512), (4096, 4608)], version)   # memoryviews, in the order asked

`Range: bytes=a-b,c-d,...` is answered by static HTTP servers (nginx, Caddy, Starlette's
FileResponse) with one `multipart/byteranges` body: each part its own `Content-Range`. Object stores
(S3, GCS) answer one range per request. So where a server answers them, a row-split tensor's slices
come exactly, as ranges of one request (at tp=8 a rank's slice of a 4 KiB row is 512 bytes, 7/8 of
the row block a single range would cost), instead of as the row block that covers them. Whether a
server answers them is asked once per store root (two 1-byte ranges of the first object read).

The answer's ETag must be the planned version (a replaced object fails the stream), the parts must
cover every range asked for (a server may merge neighbouring ranges into one part), and a server that
answers the whole object (200) is not asked again. Timeouts, dropped connections and 5xx answers are
retried with backoff, like the store client's (`RESHARD_STORE_RETRIES`, `RESHARD_STORE_TIMEOUT`).
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import httpx

from reshard.errors import CheckpointError, SourceChangedError, StoreError, StoreUnavailableError
from reshard.io.stores import count_fetched
from reshard.settings import library_settings

_RANGE = re.compile(rb"content-range:\s*bytes\s+(\d+)-(\d+)/\d+", re.I)
_BOUNDARY = re.compile(r"boundary=\"?([^\";]+)\"?", re.I)


class Unanswered(Exception):
    """The server did not answer several ranges in one body: ask it one range per request."""


class MultiRangeClient:
    """A connection pool to one HTTP(S) store root (`http://HOST:PORT`)."""

    def __init__(self, root: str) -> None:
        settings = library_settings()
        self.root, self.retries = root.rstrip("/"), settings.store_retries
        self._http = httpx.Client(timeout=httpx.Timeout(settings.store_timeout, connect=10.0), follow_redirects=True,
                                  limits=httpx.Limits(max_connections=settings.store_concurrency))
        self.most = settings.store_ranges  # ranges per request; halved where the server answers fewer

    def get(self, key: str, ranges: list[tuple[int, int]], version: str) -> list[memoryview]:
        """Bytes [a, b) of object `key` for each (a, b) of `ranges` (ascending, disjoint)."""
        failures = 0
        while True:
            try:
                return self._get(key, ranges, version)
            except (httpx.TransportError, _Retry) as e:
                failures += 1
                if failures > self.retries:
                    raise StoreUnavailableError(f"{self.root}/{key}: {len(ranges)} ranges failed after "
                                                f"{self.retries} retries ({e})") from None
                time.sleep(min(0.1 * 2 ** (failures - 1), 5.0))

    def _get(self, key: str, ranges: list[tuple[int, int]], version: str) -> list[memoryview]:
        url = f"{self.root}/{key}"
        spec = ",".join(f"{a}-{b - 1}" for a, b in ranges)
        with self._http.stream("GET", url, headers={"Range": f"bytes={spec}", "Accept-Encoding": "identity"}) as r:
            if r.status_code >= 500:
                raise _Retry(f"HTTP {r.status_code}")
            if r.status_code == 404:
                raise CheckpointError(f"{url}: no such object")
            if r.status_code in (200, 416) or (r.status_code == 206 and len(ranges) > 1
                                               and "multipart/byteranges" not in r.headers.get("content-type", "")):
                raise Unanswered(f"{url}: HTTP {r.status_code} {r.headers.get('content-type')}")  # not read
            if r.status_code != 206:
                raise StoreError(f"{url}: the server answered {r.status_code} to a ranged GET")
            etag = r.headers.get("etag")
            if etag != version:
                raise SourceChangedError(f"{url}: replaced while being read (ETag {etag}, planned {version}); "
                                         "re-plan and retry")
            raw = r.read()
            count_fetched(len(raw))
            parts = _parts(raw, r.headers) if "multipart/byteranges" in r.headers.get("content-type", "") \
                else [(ranges[0][0], memoryview(raw))]
        return [_slice(parts, a, b, url) for a, b in ranges]


class _Retry(Exception):
    pass


def _parts(raw: bytes, headers: httpx.Headers) -> list[tuple[int, memoryview]]:
    """(first byte, bytes) of each part of a multipart/byteranges body."""
    m = _BOUNDARY.search(headers.get("content-type", ""))
    if m is None:
        raise StoreError("a multipart/byteranges answer without a boundary")
    delim = b"--" + m.group(1).encode("latin-1")
    body, parts, pos = memoryview(raw), [], 0
    while True:
        at = raw.find(delim, pos)
        if at < 0 or raw[at + len(delim) : at + len(delim) + 2] == b"--":
            return parts
        head_end = raw.find(b"\r\n\r\n", at)
        m2 = _RANGE.search(raw, at, head_end) if head_end > 0 else None
        if m2 is None:
            raise StoreError("a part of a multipart/byteranges answer without its Content-Range")
        first, last = int(m2.group(1)), int(m2.group(2))
        start = head_end + 4
        parts.append((first, body[start : start + last - first + 1]))
        pos = start + last - first + 1


def _slice(parts: list[tuple[int, memoryview]], a: int, b: int, url: str) -> memoryview:
    for first, data in parts:
        if first <= a and b <= first + len(data):
            return data[a - first : b - first]
    raise StoreError(f"{url}: the server's answer lacks bytes {a}-{b - 1}")


_CLIENTS: dict[str, MultiRangeClient | None] = {}
_LOCK = threading.Lock()


def client_for(store: Any, key: str, version: str) -> MultiRangeClient | None:
    """The multi-range client of `store`'s root where it is HTTP(S) and answers several ranges in one
    body (asked once per root, with two 1-byte ranges of `key`), else None."""
    if not store.root.lower().startswith(("http://", "https://")) or not version or version.startswith(
            ("mtime:", "version:")) or not library_settings().store_multirange:
        return None
    with _LOCK:
        if store.root in _CLIENTS:
            return _CLIENTS[store.root]
        client: MultiRangeClient | None = MultiRangeClient(store.root)
        assert client is not None
        try:
            client.get(key, [(0, 1), (2, 3)], version)
        except (Unanswered, StoreError, CheckpointError, SourceChangedError, httpx.HTTPError):
            client = None  # one range per request; a real failure is met again by the stream's own reads
        _CLIENTS[store.root] = client
        return client


__all__ = ["MultiRangeClient", "Unanswered", "client_for"]
