"""uvicorn's httptools protocol with bounded request heads: what `reshard serve` runs, in every worker.

uvicorn (0.54) keeps every byte of a request head until it is complete (llhttp itself has no limit):
a client could send a gigabyte of headers, and the worker held it all before the app, or the token
check, saw the request. `BoundedProtocol` counts the head as it arrives, before anything else runs:

- the request target (`on_url`, fed piece by piece) over `url_bytes`: 414;
- more than `headers` header fields, or their bytes (names, values, separators) over `header_bytes`: 431;
- the whole head, counted as it is fed to the parser, over `url_bytes + header_bytes + 1 KiB` (a
  single header whose value never ends, a flood of blank lines) before it is complete: 431. The parser
  is fed at most that much of a head, so a worker holds no more of it;
- a head that does not arrive whole within `head_timeout` seconds of the connection opening or of its
  first byte: 408 (a connection that sent nothing is closed silently). uvicorn's keep-alive timeout
  only starts after a first response, so a connection that never sent a request stayed open;
- a head the parser rejects: 400 (uvicorn answered those in plain text).

Each answer has the service's JSON body `{"error": ..., "detail": ...}` and `Connection: close`; the
connection then half-closes and discards what the client still sends for a moment (at most
`LINGER_S` seconds or `LINGER_BYTES`), so the client reads the answer before the reset a close of
unread data sends (nginx's lingering close). If a response is still going out on the connection (a
pipelined request), nothing is written: the connection closes once that response ends. The cost on
the request path is a few counters per request.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from reshard.service.http_errors import error_body

HEAD_SLACK = 1 << 10  # request line beyond its target: method, version, line ends
LINGER_S = 2.0  # after a refusal: how long the client's further bytes are read and dropped
LINGER_BYTES = 1 << 20  # ... and how many, at most
log = logging.getLogger("reshard.service")


@dataclass(frozen=True)
class HeadLimits:
    """Bounds of one request head (see the module's docstring); `Settings` fields of the same meaning."""

    header_bytes: int = 64 << 10
    headers: int = 100
    url_bytes: int = 8 << 10
    head_timeout: float = 30.0

    @classmethod
    def from_settings(cls, settings: Any) -> HeadLimits:
        return cls(header_bytes=settings.max_header_bytes, headers=settings.max_headers,
                   url_bytes=settings.max_url_bytes, head_timeout=settings.keep_alive_timeout)


class _Refusal(Exception):
    """Raised in a parser callback to stop the parser; the answer is in `BoundedProtocol._refusal`."""


class BoundedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `HeadLimits`; uvicorn makes one per connection (`http=` of
    its config takes `functools.partial(BoundedProtocol, limits=...)`)."""

    def __init__(self, *args: Any, limits: HeadLimits | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits if limits is not None else HeadLimits()
        self._head_max = self.limits.url_bytes + self.limits.header_bytes + HEAD_SLACK
        self._in_head = True  # between a message's end (or the connection's start) and its headers' end
        self._head_seen = 0  # bytes fed to the parser while in a head
        self._url_seen = self._fields = self._field_bytes = 0
        self._refusal: tuple[int, str, str] | None = None
        self._refused = False
        self._dropped = 0
        self._timer: asyncio.TimerHandle | None = None

    # --- the connection --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:  # after a refusal: drop what still comes
            if self.cycle is None or self.cycle.response_complete:  # lingering after the answer
                self._dropped += len(data)
                if self._dropped > LINGER_BYTES:
                    self.transport.close()
            return
        while data:
            if self._in_head:
                if self._timer is None:
                    self._arm()  # a head's first byte after a response (keep-alive blank lines too)
                budget = self._head_max - self._head_seen
                part, data = (data, b"") if len(data) <= budget else (data[:budget], data[budget:])
                self._head_seen += len(part)
            else:
                part, data = data, b""
            self._feed(part)
            if self._refused or self.parser is None or self.transport.get_protocol() is not self:
                return
            if self._in_head and self._head_seen >= self._head_max:
                self._refuse(431, "RequestHeaderFieldsTooLarge",
                             f"request head longer than {self._head_max} bytes; the server's limits: "
                             f"{self.limits.url_bytes}-byte target, {self.limits.header_bytes} bytes of headers")
                return

    def _feed(self, data: bytes) -> None:
        """uvicorn's `data_received`, with JSON answers to what the parser refuses."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as e:
            if self._refusal is None:  # the parser's own reason, not a callback's exception
                why = "" if isinstance(e, httptools.HttpParserCallbackError) else f": {e}"
                self._refusal = (400, "BadRequest", f"invalid HTTP request{why}")
            self._refuse(*self._refusal)

    # --- parser callbacks ----------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._url_seen = self._fields = self._field_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url_seen += len(url)
        if self._url_seen > self.limits.url_bytes:
            self._stop(414, "URITooLong", f"request target longer than {self.limits.url_bytes} bytes "
                       "(the server's --max-url-bytes)")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        self._field_bytes += len(name) + len(value) + 4  # ": " and the line end
        if self._fields > self.limits.headers:
            self._stop(431, "RequestHeaderFieldsTooLarge",
                       f"more than {self.limits.headers} header fields (the server's --max-headers)")
        if self._field_bytes > self.limits.header_bytes:
            self._stop(431, "RequestHeaderFieldsTooLarge",
                       f"header fields longer than {self.limits.header_bytes} bytes (the server's --max-header-bytes)")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._head_seen = True, 0

    def _stop(self, status: int, error: str, detail: str) -> None:
        self._refusal = (status, error, detail)
        raise _Refusal(detail)

    # --- answers -------------------------------------------------------------------------------------

    def _arm(self) -> None:
        self._disarm()
        self._timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._refused or self.transport.is_closing():
            return
        if self._head_seen:
            self._refuse(408, "RequestTimeout",
                         f"the request head did not arrive within {self.limits.head_timeout:g} s")
        elif self.cycle is None or self.cycle.response_complete:
            self.transport.close()  # nothing was asked: no answer (as a keep-alive timeout)

    def _refuse(self, status: int, error: str, detail: str) -> None:
        """Answer `status` with the JSON error body and close, or, while a response is still going
        out on this connection, close once it ends."""
        if self._refused:
            return
        self._refused = True
        self._disarm()
        log.warning("%s - refused a request: %d %s", f"{self.client[0]}:{self.client[1]}" if self.client else "-", status, detail)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False
            return
        body = json.dumps(error_body(error, detail)).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                 b"\r\nconnection: close\r\n\r\n", body]
        self.transport.write(b"".join(head))
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()
