"""The one place where errors become HTTP answers: `{"error": <name>, "detail": <text>}`.

Library errors (`reshard.errors.ReshardError`) know nothing of HTTP: `_STATUS` maps each class (and
the few errors only the service raises, declared here) to its status, a subclass not in it taking its
nearest listed base's; the output side's errors (`OutputError`: no space 507, quota 507, read-only 503,
permission 503, path 409, I/O 503) too, and an untyped
OSError of a full or read-only disk is typed here before it is answered. Request validation answers 422, unknown
routes 404, wrong methods 405, all with the same JSON shape. Anything else is a bug: it is logged with
its traceback and answered 500 without internals.

No answer shows where the server keeps its files (`ServerPaths`): a path under the root is named
relative to it (`ckpt/model.safetensors`), one under the output, state or gather directory from that
directory's name (`OUT/ckpt/tp-2`, `STATE/...`, `GATHER_DIR/...`, `CACHE/...` for a store root's
stored manifests), and any other absolute path of the server by its last part (`.../name`).
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from reshard.errors import (
    CheckpointError,
    HeaderError,
    IntegrityError,
    ManifestError,
    MissingDependencyError,
    NoSpaceError,
    NotFoundError,
    OutputError,
    OutputIOError,
    OutputPathError,
    OutputPermissionError,
    PeerFailedError,
    PlanError,
    QuotaError,
    ReadOnlyError,
    RegistryError,
    ReshardError,
    SourceChangedError,
    StateFullError,
    StateUnavailableError,
    StoreError,
    StoreUnavailableError,
)
from reshard.io.outfs import output_error

log = logging.getLogger("reshard.service")
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


class BadRequest(ReshardError):
    """A malformed name, path or parameter."""


class Unauthorized(ReshardError):
    """Missing or wrong bearer token."""


class Conflict(ReshardError):
    """The request collides with the state of the server (e.g. a file being replaced)."""


class PayloadTooLarge(ReshardError):
    """An upload larger than `max_upload_bytes`."""


class TooBusy(ReshardError):
    """The worker holds as many pending write jobs as it takes (`max_jobs_pending`): 429."""


class RangeNotSatisfiable(ReshardError):
    """A `Range` that starts at or past the end of the shard."""

    def __init__(self, message: str, *, size: int) -> None:
        super().__init__(message)
        self.size = size


# library error class -> HTTP status; a class not listed answers its nearest listed base's (`status_for`)
_STATUS: dict[type[BaseException], int] = {
    ReshardError: 400, BadRequest: 400, Unauthorized: 401, Conflict: 409, PayloadTooLarge: 413,
    RangeNotSatisfiable: 416, TooBusy: 429, NotFoundError: 404, SourceChangedError: 409,
    HeaderError: 422, CheckpointError: 422, ManifestError: 422, RegistryError: 422, PlanError: 422,
    IntegrityError: 502, StoreError: 502, StoreUnavailableError: 503, PeerFailedError: 503,
    OutputError: 507, NoSpaceError: 507, QuotaError: 507, ReadOnlyError: 503,
    OutputPermissionError: 503, OutputPathError: 409, OutputIOError: 503,
    StateUnavailableError: 503, StateFullError: 507,
    MissingDependencyError: 503,  # the server lacks a package (torch, transformers) for what was asked
}
_STATUS_NAMES = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
                 405: "MethodNotAllowed", 408: "RequestTimeout", 409: "Conflict", 413: "PayloadTooLarge",
                 414: "URITooLong", 415: "UnsupportedMediaType", 416: "RangeNotSatisfiable", 422: "ValidationError",
                 429: "TooManyRequests", 431: "RequestHeaderFieldsTooLarge", 503: "ServiceUnavailable", 507: "InsufficientStorage"}
# an OSError of the output side that names no file (a write into an open file): no path, no free space to tell
_UNNAMED = {errno.ENOSPC: (NoSpaceError, "no space left on the server's disk; free some space there, then try again"),
            errno.EDQUOT: (QuotaError, "disk quota exceeded on the server; free some space there, then try again"),
            errno.EROFS: (ReadOnlyError, "the server's disk is read-only; remount it read-write, then try again")}
_END = r"""\s'"`:,;()\[\]{}<>"""  # what ends a path in a message
# an absolute path, and what follows it across spaces while each piece holds a `/` (`/srv/my models/x`)
_ABSOLUTE = re.compile(rf"(?<![\w.~:/\\-])/[^{_END}]+(?: [^{_END}/]*/[^{_END}]*)*")


class ServerPaths:
    """The server's directories as error details may name them: `dirs` of (path, name, prefix), a path
    `P/rest` shown as `prefix + rest` and `P` alone as `name`; other absolute paths of the server (their
    first component exists here) as `.../last part`. `hide(text)` rewrites a detail."""

    def __init__(self, dirs: Sequence[tuple[str, str, str]] = ()) -> None:
        seen: dict[str, tuple[str, str]] = {}
        for path, name, prefix in dirs:
            for form in {path.rstrip("/"), os.path.realpath(path)}:
                if form not in ("", "/") and form not in seen:
                    seen[form] = (name, prefix)
        self._dirs = sorted(seen.items(), key=lambda d: -len(d[0]))  # the innermost first

    @classmethod
    def of(cls, settings: Any) -> ServerPaths:
        """The directories of `settings` (a `reshard.service.serve_settings.Settings`)."""
        dirs = [(str(settings.out_dir), "OUT", "OUT/"), (str(settings.jobs_dir), "STATE", "STATE/"),
                (str(settings.gathered_dir), "GATHER_DIR", "GATHER_DIR/")]
        if isinstance(settings.root, Path):
            dirs.append((str(settings.root), "ROOT", ""))
        else:  # a root in a store: its stored manifests are in a local cache
            dirs.append((str(settings.state_dir), "CACHE", "CACHE/"))
        return cls(dirs)

    def hide(self, text: str) -> str:
        for path, (name, prefix) in self._dirs:
            if path in text:
                text = re.sub(rf"(?<![\w.~/-]){re.escape(path)}(?:(/)|(?=\.?(?:[{_END}]|$)))",
                              lambda m, n=name, p=prefix: p if m.group(1) else n, text)
        return _ABSOLUTE.sub(_elide, text)


def _elide(m: re.Match[str]) -> str:
    """An absolute path of this machine as `.../last part`; anything else (a URL path) as it is. A path
    with spaces is the longest run of the match whose directory exists here (else up to the first space)."""
    text = m.group(0)
    pieces = text.split(" ")
    path = pieces[0]
    for k in range(len(pieces), 1, -1):
        longer = " ".join(pieces[:k]).rstrip(".")
        if os.path.isdir(os.path.dirname(longer.rstrip("/"))):
            path = longer
            break
    path = path.rstrip(".")
    top = path.split("/")[1]
    if not top or not os.path.lexists("/" + top):
        return text
    return ".../" + os.path.basename(path.rstrip("/")) + text[len(path):]



class ErrorOut(BaseModel):
    """The body of every 4xx/5xx answer."""

    error: str
    detail: str


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error codes a route can answer (JSON even where the route's own
    media type is not; 422 replaces FastAPI's default validation-error schema)."""
    schema = ErrorOut.model_json_schema()
    return {code: {"description": _STATUS_NAMES.get(code, "error"), "content": {"application/json": {"schema": schema}}}
            for code in codes}


def typed(exc: BaseException) -> BaseException:
    """An OSError that can only come from writing (full disk, quota, read-only file system) as its
    `reshard.errors.OutputError` (507 / 503); any other exception as it is."""
    if isinstance(exc, OSError) and exc.errno in _WRITE_ERRNOS:
        if not exc.filename:
            cls, text = _UNNAMED[exc.errno]
            return cls(text)
        return output_error(exc, exc.filename) or exc
    return exc


def status_for(exc: BaseException) -> int:
    """The HTTP status of an exception raised while answering a request."""
    exc = typed(exc)
    if isinstance(exc, ReshardError):
        return next(_STATUS[c] for c in type(exc).__mro__ if c in _STATUS)  # ReshardError ends every such MRO
    if isinstance(exc, FileNotFoundError):
        return 404
    return 500


def error_body(error: str, detail: str) -> dict[str, str]:
    return {"error": error, "detail": detail}


def error_response(status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error, detail), status_code=status, headers=headers)


def response_for(exc: BaseException, *, hide: ServerPaths | str | None = None) -> JSONResponse:
    """The JSON answer to `exc` (also used by middleware and the shard stream before it starts).

    The detail names no server path (`ServerPaths.hide`): `hide` gives the server's directories (a
    string: the served root), so answers name `ckpt/file`; without it absolute paths are elided.
    """
    exc = typed(exc)
    status = status_for(exc)
    headers: dict[str, str] = {}
    if isinstance(exc, RangeNotSatisfiable):
        headers["Content-Range"] = f"bytes */{exc.size}"
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    if status >= 500 and not isinstance(exc, ReshardError):
        return error_response(500, "InternalError", "internal error; see the server log")
    detail = str(exc) if not isinstance(exc, FileNotFoundError) else f"{exc.filename or 'file'}: no such file"
    paths = ServerPaths([(hide, "ROOT", "")]) if isinstance(hide, str) else hide or ServerPaths()
    detail = paths.hide(detail)
    return error_response(status, type(exc).__name__, detail, headers or None)


def _validation_detail(errors: Any) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "request"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)[:2000]


def served_root(app: Any) -> ServerPaths:
    """The server's directories to hide from error details, from `app.state.settings` when there is one."""
    settings = getattr(getattr(app, "state", None), "settings", None)
    return ServerPaths.of(settings) if settings is not None else ServerPaths()


async def _reshard_error(request: Request, exc: Exception) -> JSONResponse:
    return response_for(exc, hide=served_root(request.app))


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(422, "ValidationError", _validation_detail(exc.errors()))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    name = _STATUS_NAMES.get(exc.status_code, "HTTPError")
    detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404 and detail == "Not Found":
        detail = f"no route {request.method} {request.url.path}"
    return error_response(exc.status_code, name, detail, dict(exc.headers) if exc.headers else None)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    if status_for(exc) < 500 or isinstance(typed(exc), ReshardError):  # a full disk is no bug
        return response_for(exc, hide=served_root(request.app))
    log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
    return response_for(exc)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers; call once from `create_app`."""
    app.add_exception_handler(ReshardError, _reshard_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(FileNotFoundError, _unexpected)
    # an OSError is answered here, not by Starlette's last-resort middleware, which re-raises it to the
    # server after answering (a full disk would log "Exception in ASGI application" with a traceback)
    app.add_exception_handler(OSError, _unexpected)
    app.add_exception_handler(Exception, _unexpected)
