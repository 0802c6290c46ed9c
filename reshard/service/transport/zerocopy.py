"""The ASGI zero-copy send extension (`http.response.zerocopysend`) on uvicorn's httptools protocol.

A file range goes from the page cache to the socket with `os.sendfile`: no byte passes through
Python, as with nginx's `sendfile on`. uvicorn (0.54) does not implement the extension (its pull
request encode/uvicorn#1210 was never merged), so `ZeroCopyProtocol` adds it to the protocol
`reshard serve` runs (uvicorn's httptools protocol with bounded request heads, `BoundedProtocol`): every request's scope lists the extension, and the app's `send` accepts

    {"type": "http.response.zerocopysend", "file": fd or file object, "offset": int, "count": int,
     "more_body": bool}

after `http.response.start`, mixed freely with `http.response.body` messages (the ASGI spec's keys;
`offset` and `count` are required here). Bytes go out in order: the transport's buffer is drained
before a file range starts, and the range is sent before `send` returns. Any other server (TestClient,
hypercorn, granian) simply does not list the extension and the app copies instead.

How it sends, each choice measured (`python -m bench.serve_options`, one client, tp=4 column rank):
- On the event loop, nginx's way: `sendfile` of at most `CALL_MAX` bytes per call on the
  non-blocking socket, waiting for room with `add_writer` (on a duplicate of the socket's
  descriptor, which the transport owns). A thread per range cost ~5% more (a hand-off each way).
- A call whose last byte is not in the page cache (`preadv2` with `RWF_NOWAIT`) runs in a thread,
  so a cold file never blocks the loop; that thread works on duplicates of both descriptors, so a
  cancelled send returns at once and nothing it uses is closed under it.
- `TCP_NODELAY` (which uvicorn sets) is off while a range goes out and back on after it, which
  pushes the range's last segment: with it on, loopback transfers were 10-15% slower.
A file that ends before `count` bytes raises `EOFError`; a connection the peer closed marks the
request disconnected (later sends do nothing), as uvicorn does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from reshard.service.transport.protocol import BoundedProtocol
from reshard.service.transport.pump import ZERO_COPY as EXTENSION

CALL_MAX = 2 << 20  # bytes per sendfile call (nginx's sendfile_max_chunk): other streams get the loop between
BULK = 256 << 10  # a body message this long turns TCP_NODELAY off until the response ends
_COLD = ThreadPoolExecutor(max_workers=16, thread_name_prefix="reshard-sendfile")

Send = Callable[[dict[str, Any]], Awaitable[None]]
# what `ZeroCopySend` uses of uvicorn's request cycle (0.54, pinned in constraints.txt); a uvicorn
# without them (or without `_start_asgi_task`) gets no extension and the app copies
_CYCLE = ("transport", "flow", "disconnected", "response_started", "response_complete", "chunked_encoding",
          "expected_content_length", "scope")


def cached(fd: int, offset: int) -> bool:
    """Whether the byte at `offset` of `fd` is in the page cache (a read that must not wait)."""
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    except OSError:  # RWF_NOWAIT unsupported here: assume it may block
        return False
    return True


def _sendfile_closing(sock: int, fd: int, offset: int, count: int) -> int:
    """One `sendfile` call on duplicates of both descriptors, closed after (runs in a thread)."""
    try:
        return os.sendfile(sock, fd, offset, count)
    finally:
        os.close(sock)
        os.close(fd)


def _retrieved(fut: asyncio.Future[int]) -> None:
    """Mark a shielded sendfile's outcome as seen: when its stream was cancelled (the client left),
    nobody awaits it, and its BrokenPipeError would be logged as a traceback at garbage collection."""
    if not fut.cancelled():
        fut.exception()


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():  # a writable callback may fire again before it is removed
        ready.set_result(None)


async def send_range(sock: int, fd: int, offset: int, count: int) -> int:
    """`count` bytes of `fd` from `offset` into the non-blocking socket `sock` (a duplicate the
    caller closes); the bytes sent, fewer than `count` only if the file ended."""
    loop = asyncio.get_running_loop()
    sent = 0
    while sent < count:
        n = min(count - sent, CALL_MAX)
        try:
            if cached(fd, offset + sent + n - 1):
                n = os.sendfile(sock, fd, offset + sent, n)
            else:
                cold = loop.run_in_executor(_COLD, _sendfile_closing, os.dup(sock), os.dup(fd), offset + sent, n)
                cold.add_done_callback(_retrieved)
                n = await asyncio.shield(cold)
        except BlockingIOError:  # the socket is full: wait for room
            ready = loop.create_future()
            loop.add_writer(sock, _wake, ready)
            try:
                await ready
            finally:
                loop.remove_writer(sock)
            continue
        if n == 0:  # end of file
            break
        sent += n
    return sent


class ZeroCopySend:
    """The `send` an app sees: zero-copy messages here, everything else to uvicorn's cycle."""

    def __init__(self, cycle: RequestResponseCycle, send: Send) -> None:
        self.cycle, self._send = cycle, send
        self._bulk = False  # TCP_NODELAY off until the response ends

    def _nodelay(self, on: bool) -> None:
        if self._bulk == on and not self.cycle.disconnected:
            with contextlib.suppress(OSError):
                self.cycle.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(on))
            self._bulk = not on

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] != EXTENSION:
            if message["type"] == "http.response.body" and len(message.get("body", b"")) >= BULK:
                self._nodelay(False)
            await self._send(message)
            if not message.get("more_body", False):
                self._nodelay(True)  # pushes the last segment
            return
        cycle = self.cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        if not cycle.response_started or cycle.response_complete:
            raise RuntimeError(f"{EXTENSION} before http.response.start or after the response ended")
        file = message["file"]
        fd = file if isinstance(file, int) else file.fileno()
        offset, count = int(message["offset"]), int(message["count"])
        if count > cycle.expected_content_length or cycle.chunked_encoding or cycle.scope["method"] == "HEAD":
            raise RuntimeError(f"{EXTENSION} of {count} bytes: the response needs a Content-Length that covers them")
        await self._drained()
        if cycle.disconnected:
            return
        self._nodelay(False)
        sock = os.dup(cycle.transport.get_extra_info("socket").fileno())  # the transport owns its fd
        try:
            sent = await send_range(sock, fd, offset, count)
        except (BrokenPipeError, ConnectionResetError):
            cycle.disconnected = True
            return
        finally:
            os.close(sock)
        cycle.expected_content_length -= sent
        if sent < count:
            raise EOFError(f"the file ended {count - sent} bytes before the range of {count} bytes at {offset}")
        if not message.get("more_body", False):
            await self({"type": "http.response.body", "body": b"", "more_body": False})

    async def _drained(self) -> None:
        """Wait until the transport has written everything it holds: with a high-water mark of 0 the
        transport pauses the protocol until its buffer is empty, and uvicorn's flow control waits."""
        transport, flow = self.cycle.transport, self.cycle.flow
        if not transport.get_write_buffer_size():
            return
        low, high = transport.get_write_buffer_limits()
        transport.set_write_buffer_limits(high=0, low=0)
        try:
            while transport.get_write_buffer_size() and not self.cycle.disconnected:
                if flow.write_paused:
                    await flow.drain()
                else:
                    await asyncio.sleep(0.001)
        finally:
            transport.set_write_buffer_limits(high=high, low=low)


class ZeroCopyProtocol(BoundedProtocol):
    """uvicorn's httptools protocol, bounded (`reshard.service.transport.protocol`), with the zero-copy send
    extension (not over TLS: the kernel cannot encrypt what `sendfile` sends)."""

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: Any) -> None:
        if self.transport.get_extra_info("sslcontext") is not None or not all(hasattr(cycle, a) for a in _CYCLE):
            super()._start_asgi_task(cycle, app)  # TLS, or a uvicorn whose request cycle is not the one known
            return

        async def with_zerocopy(scope: dict[str, Any], receive: Any, send: Send) -> None:
            scope.setdefault("extensions", {})[EXTENSION] = {}
            await app(scope, receive, ZeroCopySend(cycle, send))

        super()._start_asgi_task(cycle, with_zerocopy)
