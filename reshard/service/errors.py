"""The one place where errors become HTTP answers: `{"error": <name>, "detail": <text>}`.

Library errors (`reshard.errors.ReshardError`) carry their status in `http_status`; the few errors
only the service raises are declared here the same way; the output side's errors (`OutputError`:
no space 507, quota 507, read-only 503, permission 503, path 409, I/O 503) too, and an untyped
OSError of a full or read-only disk is typed here before it is answered. Request validation answers 422, unknown
routes 404, wrong methods 405, all with the same JSON shape. Anything else is a bug: it is logged with
its traceback and answered 500 without internals.
"""

from __future__ import annotations

import errno
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from reshard.errors import ReshardError
from reshard.io.outfs import output_error

log = logging.getLogger("reshard.service")
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


class BadRequest(ReshardError):
    """A malformed name, path or parameter."""

    http_status = 400


class Unauthorized(ReshardError):
    """Missing or wrong bearer token."""

    http_status = 401


class Conflict(ReshardError):
    """The request collides with the state of the server (e.g. a file being replaced)."""

    http_status = 409


class PayloadTooLarge(ReshardError):
    """An upload larger than `max_upload_bytes`."""

    http_status = 413


class RangeNotSatisfiable(ReshardError):
    """A `Range` that starts at or past the end of the shard."""

    http_status = 416

    def __init__(self, message: str, *, size: int) -> None:
        super().__init__(message)
        self.size = size


_STATUS_NAMES = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
                 405: "MethodNotAllowed", 409: "Conflict", 413: "PayloadTooLarge", 415: "UnsupportedMediaType",
                 416: "RangeNotSatisfiable", 422: "ValidationError", 503: "ServiceUnavailable",
                 507: "InsufficientStorage"}



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
        return output_error(exc, exc.filename or "the server's disk") or exc
    return exc


def status_for(exc: BaseException) -> int:
    """The HTTP status of an exception raised while answering a request."""
    exc = typed(exc)
    if isinstance(exc, ReshardError):
        return int(getattr(exc, "http_status", 400))
    if isinstance(exc, FileNotFoundError):
        return 404
    return 500


def error_body(error: str, detail: str) -> dict[str, str]:
    return {"error": error, "detail": detail}


def error_response(status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error, detail), status_code=status, headers=headers)


def response_for(exc: BaseException, *, hide: str | None = None) -> JSONResponse:
    """The JSON answer to `exc` (also used by middleware and the shard stream before it starts).

    `hide` (the served root) is cut from the detail, so answers name `ckpt/file`, not server paths.
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
    if hide:
        detail = detail.replace(hide.rstrip("/") + "/", "")
    return error_response(status, type(exc).__name__, detail, headers or None)


def _validation_detail(errors: Any) -> str:
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "request"
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)[:2000]


def served_root(app: Any) -> str | None:
    """The root to hide from error details, from `app.state.settings` when there is one."""
    settings = getattr(getattr(app, "state", None), "settings", None)
    return str(settings.root) if settings is not None else None


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
    if status_for(exc) < 500:
        return response_for(exc, hide=served_root(request.app))
    log.error("unexpected error answering %s %s", request.method, request.url.path, exc_info=exc)
    return response_for(exc)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers; call once from `create_app`."""
    app.add_exception_handler(ReshardError, _reshard_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(FileNotFoundError, _unexpected)
    app.add_exception_handler(Exception, _unexpected)
