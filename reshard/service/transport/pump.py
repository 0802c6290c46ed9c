"""The body of one shard response: a reader thread fills chunks, the event loop sends them.

`BodyPump.run()` sends the bytes [start, end) of an open `RankStream` and returns how it ended:
'complete', 'disconnected', 'timeout' (the client took no chunk for `send_timeout` seconds) or
'error' (a source changed: the body is cut short). Three tasks share one cancel scope:

- `produce` walks the stream's runs: a run the kernel can copy (`src`: a file range) is passed on as
  it is (a block of the store cache still being fetched is waited for in a thread first), any other is read in a worker thread into a pooled chunk buffer (checked afterwards that no
  source changed, fed to the gathered copy being written, hashed when the whole body is);
- `consume` sends each item (a chunk, or a zero-copy `sendfile` message), checks the sources after a
  kernel copy, and counts what went out in one place (`_sent`);
- `watch` ends everything when the client disconnects.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
from starlette.types import Receive, Send

from reshard.errors import ReshardError, SourceChangedError
from reshard.io.rank_stream import NO_COPIES, RankStream
from reshard.service.prometheus import ServiceMetrics
from reshard.service.transport.buffers import POOL
from reshard.service.transport.gathered import Copier, Copy

log = logging.getLogger("reshard.service")

ZERO_COPY = "http.response.zerocopysend"  # the ASGI extension; `reshard.service.transport.zerocopy` adds it to uvicorn
DIRECT_MIN = 128 << 10  # contiguous file ranges at least this long go out by sendfile

Item = memoryview | tuple[int, int, int]  # a chunk, or (fd, offset, count) of a file range


class BodyPump:
    """Sends one response body from `stream` (see the module docstring)."""

    def __init__(self, stream: RankStream, copy: Copy | Copier | None, *, start: int, end: int, size: int,
                 chunk_size: int, limiter: anyio.CapacityLimiter, metrics: ServiceMetrics, send_timeout: float,
                 zero_copy: bool, on_digest: Callable[[str], None] | None) -> None:
        self.stream, self.copy, self.start, self.end = stream, copy, start, end
        self.chunk_size, self.limiter, self.metrics, self.send_timeout = chunk_size, limiter, metrics, send_timeout
        self.on_digest = on_digest
        self.outcome, self.error = "disconnected", None
        self._at = start  # the body's bytes before this one have gone out
        whole = on_digest is not None and (start, end) == (0, size)
        self.sha = hashlib.sha256() if whole else None
        # ranges of local source files go out by sendfile where the server can (not while hashing)
        direct = zero_copy and self.sha is None
        self.runs = stream.runs(start, end, chunk_size=chunk_size, direct_min=DIRECT_MIN if direct else end + 1,
                                copies=copy if isinstance(copy, Copy) else NO_COPIES)

    async def run(self, receive: Receive, send: Send) -> str:
        self._send, self._receive = send, receive
        self._send_q, self._recv_q = anyio.create_memory_object_stream[Item](1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._produce, tg.cancel_scope.cancel)
            tg.start_soon(self._consume, tg.cancel_scope.cancel)
            tg.start_soon(self._watch, tg.cancel_scope.cancel)
        return "error" if self.error is not None else self.outcome

    def _read(self, pos: int, n: int) -> memoryview:  # called for one run at a time, in order
        buf = POOL.take(n, self.chunk_size)  # reused once the transport has let go of it; read_into fills all n
        self.stream.read_into(pos, buf)  # checks afterwards that no source changed
        if self.copy is not None:
            self.copy.feed(pos, buf)
        if self.sha is not None:
            self.sha.update(buf)
            if pos + n == self.end and self.on_digest is not None:  # cached before the last byte leaves
                self.on_digest(self.sha.hexdigest())
        return buf

    async def _produce(self, cancel: Callable[[], Any]) -> None:
        async with self._send_q:
            try:
                for pos, n, src in self.runs:
                    if callable(src):  # a block of the store cache still on its way: wait for it in a thread
                        src = await anyio.to_thread.run_sync(src, limiter=self.limiter)
                        if src is None:  # not kept on disk: its bytes are read instead
                            for at in range(pos, pos + n, self.chunk_size):
                                m = min(self.chunk_size, pos + n - at)
                                await self._send_q.send(await anyio.to_thread.run_sync(self._read, at, m, limiter=self.limiter))
                            continue
                    if src is None:
                        await self._send_q.send(await anyio.to_thread.run_sync(self._read, pos, n, limiter=self.limiter))
                    else:
                        await self._send_q.send((*src, n))
            except ReshardError as e:  # e.g. a source file changed under the stream
                self.error = e
                cancel()

    async def _consume(self, cancel: Callable[[], Any]) -> None:
        async with self._recv_q:
            async for item in self._recv_q:
                with anyio.move_on_after(self.send_timeout) as waiting:
                    try:
                        await self._send(_message(item))
                        if not isinstance(item, memoryview):  # sent by the kernel: check afterwards
                            self.stream.check_unchanged()
                    except (ReshardError, EOFError) as e:  # EOFError: a file ended early (truncated)
                        self.error = e if isinstance(e, ReshardError) else SourceChangedError(str(e))
                        cancel()
                        return
                if waiting.cancelled_caught:  # a client that stopped reading: let go of the stream
                    self.outcome = "timeout"
                    cancel()
                    return
                self._sent(item)
        if self.error is not None:
            return
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})
        self.outcome = "complete"
        cancel()

    async def _watch(self, cancel: Callable[[], Any]) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                cancel()
                return

    def _sent(self, item: Item) -> None:
        """The one place bytes that went out are counted (and the stream told: `RankStream.done`)."""
        if isinstance(item, memoryview):
            self.metrics.bytes_served.inc(len(item))
            self._at += len(item)
        else:
            self.metrics.bytes_served.inc(item[2])
            self.metrics.bytes_sendfile.inc(item[2])
            self._at += item[2]
        self.stream.done(self._at)


def _message(item: Item) -> dict[str, Any]:
    if isinstance(item, memoryview):
        return {"type": "http.response.body", "body": item, "more_body": True}
    fd, offset, count = item
    return {"type": ZERO_COPY, "file": fd, "offset": offset, "count": count, "more_body": True}
