"""Rank shard bytes over HTTP: a raw ASGI response on top of `RankStream`, ranges, ETags, digests.

The body is produced by the same `RankStream` that `reshard write` uses, so the bytes are identical.
Where the server offers ASGI's zero-copy send (`reshard serve` does: `service.zerocopy`), every
contiguous range of a local source file of at least `DIRECT_MIN` bytes goes from the page cache to
the socket by `sendfile`, and so do the gathered (row-split) pieces of a shard pulled before, from
their copy (`service.gathered`); the source files are checked after each range: a file that changed
cuts the body short. Everything else (the header, strided row-split runs, padding, and the whole body
while it is being hashed) is read by a thread into chunk buffers while the event loop sends
the previous one, checked after each read, so those bytes never mix two versions of a file. Chunk
buffers come from a pool (`service.buffers`: reused once the transport has let go of them, all given
back when a worker's last stream ends). Memory per stream is about three chunks. A full body
is hashed as it is read, so the first download of a shard also fills the digest cache. The stream
watches for the client's `http.disconnect`; when it comes, the reader stops after its current chunk
and the source files are closed.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from reshard.errors import ReshardError, SourceChangedError
from reshard.plan import RankPlan
from reshard.stream import RankStream
from service.buffers import POOL
from service.catalog import LRU
from service.errors import RangeNotSatisfiable, response_for, served_root
from service.gathered import Copier, Copy, GatherCache
from service.metrics import ServiceMetrics
from service.store import StateStore

log = logging.getLogger("reshard.service")

SHA_HEADER = "X-Reshard-Sha256"
ZERO_COPY = "http.response.zerocopysend"  # the ASGI extension; `service.zerocopy` adds it to uvicorn
DIRECT_MIN = 128 << 10  # contiguous file ranges at least this long go out by sendfile
_RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")


def shard_etag(plan_digest: str, rank: int) -> str:
    """Strong ETag: the plan digest covers source identity, manifest and tp; the rank is added."""
    return f'"{plan_digest[:40]}-r{rank}"'


def _position(digits: str) -> int:
    """A byte position from a Range header; absurdly long numbers (past any file, and past Python's
    4300-digit int parsing limit) become one huge value instead of an error."""
    digits = digits.lstrip("0") or "0"
    return int(digits) if len(digits) <= 30 else 10**30


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A single `bytes=a-b`, `a-` or `-n` range as a half-open [start, end); None for the whole body.

    Malformed or multi-range headers are ignored (RFC 9110 allows answering 200 with everything);
    a range starting at or past the end raises `RangeNotSatisfiable` (416).
    """
    if not header:
        return None
    m = _RANGE_RE.match(header)
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # suffix: the last n bytes
        n = _position(last)
        if n == 0:
            raise RangeNotSatisfiable(f"Range {header[:80]!r}: an empty suffix; the shard has {size} bytes", size=size)
        return (max(size - n, 0), size)
    start = _position(first)
    end = size if not last else min(_position(last) + 1, size)
    if last and _position(last) < start:
        return None  # invalid range: ignored
    if start >= size:
        raise RangeNotSatisfiable(f"Range {header[:80]!r} starts at or past the end of the {size}-byte shard", size=size)
    return (start, end)


def etag_matches(header: str | None, etag: str) -> bool:
    """`If-None-Match` / `If-Range` comparison (weak comparison for If-None-Match per RFC 9110)."""
    if not header:
        return False
    if header.strip() == "*":
        return True
    return any(tag.strip().removeprefix("W/") == etag for tag in header.split(","))


class DigestCache:
    """sha256 of a shard by ETag: an LRU in front of the store every worker shares (if given), so a
    digest computed by one worker is seen by all; computed at most once at a time per ETag per worker."""

    def __init__(self, maxsize: int, store: StateStore | None = None) -> None:
        self._cache: LRU[str, str] = LRU(maxsize)
        self._store = store
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, etag: str) -> str | None:
        hit = self._cache.get(etag)
        if hit is None and self._store is not None:
            hit = self._store.get_digest(etag)
            if hit is not None:
                self._cache.put(etag, hit)
        return hit

    def put(self, etag: str, sha256: str) -> None:
        self._cache.put(etag, sha256)
        if self._store is not None:
            self._store.put_digest(etag, sha256)

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


@dataclass
class StreamContext:
    """What a shard response needs from the app: metrics, chunk size, the reader-thread limit and
    how long a client may take to accept one chunk."""

    metrics: ServiceMetrics
    chunk_size: int
    threads: int
    send_timeout: float = 120.0
    gathered: GatherCache | None = None  # copies of gathered pieces (`service.gathered`), if kept
    _limiter: anyio.CapacityLimiter | None = None
    _loop: Any = None

    def limiter(self) -> anyio.CapacityLimiter:
        """One limiter per event loop (TestClient may run several loops over one app)."""
        loop = anyio.lowlevel.current_token()
        if self._limiter is None or self._loop != loop:
            self._limiter, self._loop = anyio.CapacityLimiter(self.threads), loop
        return self._limiter


class ShardResponse(Response):
    """The bytes [start, end) of one rank file, streamed; HEAD sends the headers only."""

    media_type = "application/octet-stream"

    def __init__(self, plan: RankPlan, *, ctx: StreamContext, start: int = 0, end: int | None = None,
                 status_code: int = 200, headers: dict[str, str] | None = None, head: bool = False,
                 on_digest: Callable[[str], None] | None = None) -> None:
        """`on_digest` receives the sha256 of the whole shard once a full body has been read from
        unchanged sources (even if the client then hangs up): the first download fills the cache."""
        self.plan, self.ctx, self.head, self.on_digest = plan, ctx, head, on_digest
        self.etag = (headers or {}).get("ETag")
        self.start, self.end = start, plan.size if end is None else end
        self.status_code = status_code
        self.background = None
        self.body = b""
        self.init_headers({**(headers or {}), "Content-Length": str(self.end - self.start)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.head or self.start == self.end:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        cache = self.ctx.gathered if ZERO_COPY in scope.get("extensions", {}) and self.etag else None
        whole = (self.start, self.end) == (0, self.plan.size)

        def open_stream() -> tuple[RankStream, Copy | Copier | None]:
            stream = RankStream(self.plan, chunk_size=self.ctx.chunk_size)
            try:
                return stream, cache.attach(stream, self.etag, whole=whole) if cache is not None else None
            except OSError as e:  # the copies' directory: this pull gathers as if there were none
                log.warning("copies of gathered pieces unusable: %s", e)
                return stream, None

        try:  # open (and check) the sources before the status line, so failures still get a JSON answer
            stream, copy = await anyio.to_thread.run_sync(open_stream, limiter=self.ctx.limiter())
        except ReshardError as e:
            await response_for(e, hide=served_root(scope.get("app")))(scope, receive, send)
            return
        m = self.ctx.metrics
        if isinstance(copy, Copy):
            m.gathered.labels("used").inc()
        m.active_streams.inc()
        POOL.open()
        t0 = time.monotonic()
        outcome = "error"
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            outcome = await self._body(stream, copy, scope, receive, send)
        finally:
            stream.close()  # the reader thread has returned: cancellation waits for it
            if copy is not None:
                copy.close()
                if isinstance(copy, Copier) and copy.published:
                    m.gathered.labels("written").inc()
            POOL.close()  # the process's last stream: its chunk buffers go back to the OS
            m.active_streams.dec()
            m.streams.labels(outcome).inc()
            m.stream_seconds.observe(time.monotonic() - t0)

    async def _body(self, stream: RankStream, copy: Copy | Copier | None, scope: Scope, receive: Receive,
                    send: Send) -> str:
        """Send the body; return 'complete', 'disconnected', or 'error' / 'timeout' (then the body is
        cut short: a source changed, or the client took no chunk for `send_timeout` seconds)."""
        m, chunk = self.ctx.metrics, self.ctx.chunk_size
        state: dict[str, Any] = {"outcome": "disconnected", "error": None}
        send_q, recv_q = anyio.create_memory_object_stream[memoryview | tuple[int, int, int]](1)
        whole = self.on_digest is not None and (self.start, self.end) == (0, self.plan.size)
        sha = hashlib.sha256() if whole else None
        # ranges of local source files go out by sendfile where the server can (not while hashing)
        direct = ZERO_COPY in scope.get("extensions", {}) and sha is None
        runs = stream.runs(self.start, self.end, chunk_size=chunk, direct_min=DIRECT_MIN if direct else self.end + 1)

        def read(pos: int, n: int) -> memoryview:  # called for one run at a time, in order
            buf = POOL.take(n, chunk)  # reused once the transport has let go of it; read_into fills all n
            stream.read_into(pos, buf)  # checks afterwards that no source changed
            if copy is not None:
                copy.feed(pos, buf)
            if sha is not None:
                sha.update(buf)
                if pos + n == self.end and self.on_digest is not None:  # cached before the last byte leaves
                    self.on_digest(sha.hexdigest())
            return buf

        async def produce(cancel: Callable[[], Any]) -> None:
            async with send_q:
                try:
                    for pos, n, src in runs:
                        if src is None:
                            await send_q.send(await anyio.to_thread.run_sync(read, pos, n, limiter=self.ctx.limiter()))
                        else:
                            await send_q.send((*src, n))
                except ReshardError as e:  # e.g. a source file changed under the stream
                    state["error"] = e
                    cancel()

        def message(item: memoryview | tuple[int, int, int]) -> dict[str, Any]:
            if isinstance(item, memoryview):
                return {"type": "http.response.body", "body": item, "more_body": True}
            fd, offset, count = item
            return {"type": ZERO_COPY, "file": fd, "offset": offset, "count": count, "more_body": True}

        async def consume(cancel: Callable[[], Any]) -> None:
            async with recv_q:
                async for item in recv_q:
                    with anyio.move_on_after(self.ctx.send_timeout) as waiting:
                        try:
                            await send(message(item))
                            if not isinstance(item, memoryview):  # sent by the kernel: check afterwards
                                stream.check_unchanged()
                        except (ReshardError, EOFError) as e:  # EOFError: a file ended early (truncated)
                            state["error"] = e if isinstance(e, ReshardError) else SourceChangedError(str(e))
                            cancel()
                            return
                    if waiting.cancelled_caught:  # a client that stopped reading: let go of the stream
                        state["outcome"] = "timeout"
                        cancel()
                        return
                    if isinstance(item, memoryview):
                        m.bytes_served.inc(len(item))
                    else:
                        m.bytes_served.inc(item[2])
                        m.bytes_sendfile.inc(item[2])
            if state["error"] is not None:
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            state["outcome"] = "complete"
            cancel()

        async def watch(cancel: Callable[[], Any]) -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    cancel()
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce, tg.cancel_scope.cancel)
            tg.start_soon(consume, tg.cancel_scope.cancel)
            tg.start_soon(watch, tg.cancel_scope.cancel)
        if state["error"] is not None:
            # after the status line all we can do is cut the body short; the client sees a short read
            log.warning("shard rank %d of tp=%d cut short: %s", self.plan.rank, self.plan.tp, state["error"])
            return "error"
        if state["outcome"] == "timeout":
            log.warning("shard rank %d of tp=%d dropped: the client took no data for %g s",
                        self.plan.rank, self.plan.tp, self.ctx.send_timeout)
        return state["outcome"]
