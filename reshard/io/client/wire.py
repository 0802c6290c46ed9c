"""The service's URLs and headers as a client sees them, with no HTTP library beyond the standard one.

`fill_model` from a URL needs only these and `http.client` (`reshard.io.client.body`); `ShardClient`
(`reshard.io.client.shard_client`, on httpx) uses them too.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import ssl
from urllib.parse import unquote, urlsplit, urlunsplit

from reshard import errors
from reshard.errors import NotFoundError, ReshardError
from reshard.layout.mesh import Layout
from reshard.settings import env_name, library_settings

TOKEN_ENV = env_name("token")
SHA_HEADER = "x-reshard-sha256"
RETRY_CAP = 10.0  # seconds: the longest wait between two tries of a request to the service (`reshard.io.retry`)
# the most bytes a JSON answer of the service may have (a plan listing at the service's MAX_LISTED entries is ~170 MB)
MAX_JSON_BYTES = 512 << 20
# NAME, or NAME/optimizer: a training checkpoint's optimizer state (`reshard.service.catalog.PARTS`)
_CKPT_URL = re.compile(r"^https?://[^/]+(/.*)?/v1/checkpoints/[A-Za-z0-9][A-Za-z0-9._-]*(/optimizer)?$")


def is_checkpoint_url(spec: object) -> bool:
    """Whether `spec` is the service's checkpoint URL (http://HOST:PORT/v1/checkpoints/NAME), not a store's."""
    return isinstance(spec, str) and bool(_CKPT_URL.match(spec.rstrip("/")))


def checkpoint_url(url: str) -> str:
    """`url` without a trailing slash, if it is a checkpoint URL of the service; else a `ReshardError`."""
    url = url.rstrip("/")
    if not _CKPT_URL.match(url):
        raise ReshardError(f"{redact(url)!r} is not a checkpoint URL; expected http://HOST:PORT/v1/checkpoints/NAME "
                           "(or NAME/optimizer)")
    return url


# `scheme://` followed by a URL's credentials (`user:password@`), up to the host
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#@\s]*@")


def redact(text: str) -> str:
    """`text` with the credentials (`user:password@`) of every URL in it taken out: what may be printed or logged."""
    return _USERINFO.sub(r"\1", text)


def without_credentials(url: str) -> tuple[str, dict[str, str]]:
    """`url` without its `user:password@`, and the `Authorization: Basic` header they stand for (empty: none).

    Every client of the service keeps only the URL this returns, so no message, log line or report it
    makes can show the password; the header goes with its requests instead (as httpx would send a URL's
    credentials: they take precedence over a bearer token)."""
    u = urlsplit(url)
    if "@" not in u.netloc:
        return url, {}
    userinfo, _, host = u.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    pair = f"{unquote(user)}:{unquote(password)}".encode()
    return urlunsplit(u._replace(netloc=host)), {"Authorization": "Basic " + base64.b64encode(pair).decode()}


def layout_params(layout: int | Layout) -> dict[str, int]:
    """The query parameters naming a layout (`tp`, and the other sizes that are not 1); an integer is tp."""
    if isinstance(layout, int):
        return {"tp": layout}
    return layout.given()


def as_world(layout: int | Layout) -> int:
    return layout if isinstance(layout, int) else layout.world


def auth_headers(token: str | None) -> dict[str, str]:
    """The bearer token (`token`, else `RESHARD_TOKEN`), as a header."""
    token = token if token is not None else library_settings().token or None
    return {"Authorization": f"Bearer {token}"} if token else {}


def connect(url: str, *, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    """A connection to `url`'s server (not yet opened) and the request target of `url`'s path and query."""
    u = urlsplit(url)
    host = u.hostname or "127.0.0.1"
    conn: http.client.HTTPConnection
    if u.scheme == "https":
        conn = http.client.HTTPSConnection(host, u.port, timeout=timeout, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(host, u.port, timeout=timeout)
    return conn, u.path + (f"?{u.query}" if u.query else "")


def answer_error(status: int, body: bytes, what: str) -> ReshardError:
    """The library error a 4xx answer of the service names (`{"error": CLASS, "detail": ...}`), as it was
    raised on the server; `what` (the request) leads its message."""
    try:
        obj = json.loads(body)
        name, detail = str(obj.get("error")), str(obj.get("detail"))
    except (ValueError, AttributeError):
        name, detail = "", body[:300].decode("utf-8", "replace")
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ReshardError)):
        cls = NotFoundError if status == 404 else ReshardError
    return cls(f"{what}: HTTP {status} {name}: {detail}")


__all__ = ["MAX_JSON_BYTES", "RETRY_CAP", "SHA_HEADER", "TOKEN_ENV", "answer_error", "as_world", "auth_headers",
           "checkpoint_url", "connect", "is_checkpoint_url", "layout_params", "redact", "without_credentials"]
