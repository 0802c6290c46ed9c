"""Pure ASGI middleware (no body buffering, so shard streams pass through untouched): bearer-token
access and request metrics."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reshard.service.http_errors import PayloadTooLarge, Unauthorized, response_for
from reshard.service.prometheus import ServiceMetrics

PUBLIC_PATHS = frozenset({"/healthz"})
DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
DOC_ASSETS = "/docs/assets"  # Swagger UI's and ReDoc's scripts, styles and icon, served by the app itself


class BearerAuth:
    """When a token is set, every request but the public paths (and those under `public_prefixes`) needs
    `Authorization: Bearer TOKEN`.

    The comparison is constant-time (`hmac.compare_digest`) on bytes.
    """

    def __init__(self, app: ASGIApp, *, token: str, public: frozenset[str] = PUBLIC_PATHS,
                 public_prefixes: tuple[str, ...] = ()) -> None:
        self.app, self.public, self.public_prefixes = app, public, public_prefixes
        self._expected = b"bearer " + token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.public or path.startswith(self.public_prefixes):
            await self.app(scope, receive, send)
            return
        given = b""
        for key, value in scope["headers"]:
            if key == b"authorization":
                given = value
                break
        # case-insensitive scheme; the token itself is compared exactly
        given = given[:7].lower() + given[7:]
        if not hmac.compare_digest(given, self._expected):
            why = "missing" if not given else "wrong"
            fix = "send `Authorization: Bearer TOKEN` (the server's --token)"
            if path in DOC_PATHS or path.startswith(DOC_ASSETS + "/"):  # a browser cannot send the header
                fix += "; to read the API page without it, start the server with --public-docs"
            exc = Unauthorized(f"{why} bearer token: {fix}")
            await response_for(exc)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestMetrics:
    """Counts requests by method, route template and status, and times them to the last byte."""

    def __init__(self, app: ASGIApp, *, metrics: ServiceMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]
        t0 = time.monotonic()

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except BaseException:
            status[0] = status[0] or 500
            raise
        finally:
            route = scope.get("route")
            label = getattr(route, "path", None) or ("/healthz" if scope["path"] == "/healthz" else "unmatched")
            self.metrics.requests.labels(scope["method"], label, str(status[0])).inc()
            self.metrics.request_seconds.labels(label).observe(time.monotonic() - t0)


class BodyLimit:
    """Caps request bodies (JSON manifests, job requests) at `limit` bytes, except on paths for which
    `exempt(path)` is true (uploads have their own, larger limit). A declared Content-Length over the
    limit is answered 413 before any body byte is read; a chunked body is cut off at the limit."""

    def __init__(self, app: ASGIApp, *, limit: int, exempt: Callable[[str], bool]) -> None:
        self.app, self.limit, self.exempt = app, limit, exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD") or self.exempt(scope["path"]):
            await self.app(scope, receive, send)
            return
        for key, value in scope["headers"]:
            if key == b"content-length" and value.isdigit() and int(value) > self.limit:
                exc = PayloadTooLarge(f"request body of {int(value)} bytes exceeds the {self.limit}-byte limit")
                await response_for(exc)(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"request body exceeds the {self.limit}-byte limit")
            return message

        await self.app(scope, limited, send)
