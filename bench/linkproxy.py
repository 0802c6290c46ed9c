"""A network link on 127.0.0.1: a TCP proxy whose answers (upstream -> client) share one token bucket.

    with LinkProxy(("127.0.0.1", 8000), rate_bytes=125_000_000) as link:   # 1 Gbit/s
        ... clients talk to http://127.0.0.1:{link.port} ...
        link.bytes_down, link.bytes_up                                      # bytes over the link so far

Every connection's answer bytes take tokens from the same bucket, so all the clients together get at
most `rate_bytes` per second, as the ranks of one node share its network interface (a burst of
`burst` bytes at most). Requests go up unshaped (they are small). Nothing is shaped in the kernel:
`lo` stays as it is for everyone else on the machine. Threads in the caller's process: a relay
costs a recv and a send per 64 KiB, ~0.5 CPU-seconds per GB.
"""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
import time
from typing import Any

CHUNK = 64 << 10


class TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = float(burst), time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until `n` bytes may go (n <= burst)."""
        while True:
            with self.lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= n:
                    self.tokens -= n
                    return
                wait = (n - self.tokens) / self.rate
            time.sleep(wait)


class _Relay(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.server.link._serve(self.request)  # type: ignore[attr-defined]


class LinkProxy:
    """A shaped relay to `upstream` (host, port) on a free port of 127.0.0.1 (see the module docstring)."""

    def __init__(self, upstream: tuple[str, int], *, rate_bytes: float, burst: int = 4 * CHUNK) -> None:
        self.upstream, self.bucket = upstream, TokenBucket(rate_bytes, burst)
        self.bytes_down = self.bytes_up = 0
        self._count = threading.Lock()
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Relay)
        self._server.daemon_threads = True
        self._server.link = self  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True, name="link-accept").start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LinkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _add(self, down: int = 0, up: int = 0) -> None:
        with self._count:
            self.bytes_down += down
            self.bytes_up += up

    def _serve(self, client: socket.socket) -> None:
        up = socket.create_connection(self.upstream)

        def requests() -> None:
            with contextlib.suppress(OSError):
                while data := client.recv(CHUNK):
                    self._add(up=len(data))
                    up.sendall(data)
            with contextlib.suppress(OSError):
                up.shutdown(socket.SHUT_WR)

        threading.Thread(target=requests, daemon=True, name="link-up").start()
        with contextlib.suppress(OSError):
            while data := up.recv(CHUNK):
                self.bucket.take(len(data))
                client.sendall(data)
                self._add(down=len(data))
        for s in (client, up):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def counters(self) -> dict[str, Any]:
        with self._count:
            return {"down": self.bytes_down, "up": self.bytes_up}
