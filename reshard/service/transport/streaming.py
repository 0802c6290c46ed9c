"""Rank shard bytes over HTTP: a raw ASGI response on top of `RankStream` (the body: `reshard.service.transport.pump`).

The body is produced by the same `RankStream` that `reshard write` uses, so the bytes are identical.
Where the server offers ASGI's zero-copy send (`reshard serve` does: `reshard.service.transport.zerocopy`), every
contiguous range of a local source file of at least `DIRECT_MIN` bytes goes from the page cache to
the socket by `sendfile`, and so do the gathered (row-split) pieces of a shard pulled before, from
their copy (`reshard.service.transport.gathered`); the source files are checked after each range: a file that changed
cuts the body short. Everything else (the header, strided row-split runs, padding, and the whole body
while it is being hashed) is read by a thread into chunk buffers while the event loop sends
the previous one, checked after each read, so those bytes never mix two versions of a file. Chunk
buffers come from a pool (`reshard.service.transport.buffers`: reused once the transport has let go of them, all given
back when a worker's last stream ends). Memory per stream is about three chunks. A full body
is hashed as it is read, so the first download of a shard also fills the digest cache. The stream
watches for the client's `http.disconnect`; when it comes, the reader stops after its current chunk
and the source files are closed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from reshard.errors import ReshardError
from reshard.io.rank_stream import RankStream
from reshard.plan.types import RankPlan
from reshard.service.http_errors import response_for, served_root
from reshard.service.prometheus import ServiceMetrics
from reshard.service.transport.buffers import POOL
from reshard.service.transport.gathered import Copier, Copy, GatherCache
from reshard.service.transport.pump import ZERO_COPY, BodyPump

log = logging.getLogger("reshard.service")

SHA_HEADER = "X-Reshard-Sha256"


@dataclass
class StreamContext:
    """What a shard response needs from the app: metrics, chunk size, the reader-thread limit and
    how long a client may take to accept one chunk."""

    metrics: ServiceMetrics
    chunk_size: int
    threads: int
    send_timeout: float = 120.0
    gathered: GatherCache | None = None  # copies of gathered pieces (`reshard.service.transport.gathered`), if kept
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
            pump = BodyPump(stream, copy, start=self.start, end=self.end, size=self.plan.size,
                            chunk_size=self.ctx.chunk_size, limiter=self.ctx.limiter(), metrics=m,
                            send_timeout=self.ctx.send_timeout, zero_copy=ZERO_COPY in scope.get("extensions", {}),
                            on_digest=self.on_digest)
            outcome = await pump.run(receive, send)
            if outcome == "error":
                # after the status line all we can do is cut the body short; the client sees a short read
                log.warning("shard rank %d of %d cut short: %s", self.plan.rank, self.plan.world, pump.error)
            elif outcome == "timeout":
                log.warning("shard rank %d of %d dropped: the client took no data for %g s",
                            self.plan.rank, self.plan.world, self.ctx.send_timeout)
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
