"""The answer to a boxes request as bytes read into the caller's memory: from the service, or planned here.

    body = open_boxes("http://HOST:PORT/v1/checkpoints/NAME", boxes)   # POST .../boxes (one request)
    body = open_boxes("ckpt/", boxes)       # or any source reshard reads: a directory, s3://..., http://...
    body.readinto(view)                     # the answer's bytes in order (a safetensors file), as `RankBytes`
    body.expected_sha256()                  # after the last byte (None where nothing is hashed: planned here)

From the service, `BoxBody` posts the boxes once and receives the answer straight into the caller's
buffers, as `ShardBody` receives a shard (`http.client`'s `readinto`): a broken connection resumes with
`Range: bytes=POS-` and `If-Range: ETAG` (an answer that changed meanwhile is an `IntegrityError`), and
the sha256 is the server's (`.../boxes/digest` where the header did not carry it). From any other
source the boxes are planned here (`reshard.plan.box_plan`) and read by a `RankStream`: the same bytes,
reading only what the boxes cover. `reshard.fill.box_fill` puts them into tensors.
"""

from __future__ import annotations

import http.client
import json
import os
from collections.abc import Sequence
from typing import Any

from reshard.errors import IntegrityError, ReshardError
from reshard.format.box_request import Box
from reshard.format.checkpoint import Source
from reshard.io.client.body import ShardBody, chunks_of, get_json, read_capped
from reshard.io.client.pace import Pace
from reshard.io.client.wire import (
    MAX_JSON_BYTES,
    RETRY_CAP,
    answer_error,
    auth_headers,
    checkpoint_url,
    connect,
    without_credentials,
)
from reshard.io.rank_stream import RankStream
from reshard.io.retry import Backoff, Retries, Retryable
from reshard.io.source.opener import open_tensors
from reshard.io.source.stores import is_url
from reshard.plan.box_plan import plan_boxes

__all__ = ["BoxBody", "PlannedBody", "is_service_url", "open_boxes", "tensor_listing"]


def boxes_payload(boxes: Sequence[Box]) -> bytes:
    """The request body: `{"boxes": [{"name", "offsets", "sizes"}, ...]}`."""
    return json.dumps({"boxes": [b.to_json() for b in boxes]}, separators=(",", ":")).encode()


class BoxBody(ShardBody):
    """`POST .../boxes` of the service, received into the caller's buffers (the module docstring)."""

    def __init__(self, url: str, boxes: Sequence[Box], *, token: str | None = None, timeout: float = 60.0,
                 retries: int = 5, backoff: float = 0.25) -> None:
        self.url, self._basic = without_credentials(checkpoint_url(url))  # as `ShardBody`: none in any message
        self.boxes = list(boxes)
        self._payload = boxes_payload(self.boxes)
        self._client = None
        self._start(f"{self.url}/boxes ({len(self.boxes)} boxes)", token=token, timeout=timeout, retries=retries,
                    backoff=backoff)

    def _send(self, headers: dict[str, str]) -> http.client.HTTPConnection:
        conn, target = connect(self.url + "/boxes", timeout=self.timeout)
        self._conn = conn
        conn.request("POST", target, body=self._payload, headers={**headers, "Content-Type": "application/json"})
        return conn

    def _refused(self, resp: http.client.HTTPResponse) -> None:
        body = resp.read()
        self._disconnect()
        raise answer_error(resp.status, body, f"POST {self.url}/boxes")

    def expected_sha256(self) -> str | None:
        if self.sha256 is None:  # the server did not know it when the answer started: it does now
            d = post_json(self.url + "/boxes/digest", self._payload, token=self.token, retries=self.retries,
                          timeout=max(self.timeout, 600.0), backoff=self.backoff, credentials=self._basic)
            if d["etag"] != self.etag:
                raise IntegrityError(f"{self.name}: the answer changed on the server during the download")
            self.sha256 = d["sha256"]
        return self.sha256


def post_json(url: str, payload: bytes, *, token: str | None, retries: int = 5, timeout: float = 60.0,
              backoff: float = 0.25, credentials: dict[str, str] | None = None) -> dict[str, Any]:
    """POST `payload` (JSON) to `url` of the service and return its JSON answer; a 4xx raises the error it
    names, broken connections and 5xx are tried again (`reshard.io.retry`)."""

    clean, basic = without_credentials(url)
    basic = basic or credentials or {}

    def once() -> dict[str, Any]:
        conn, target = connect(clean, timeout=timeout)
        try:
            conn.request("POST", target, body=payload,
                         headers={**auth_headers(token), **basic, "Content-Type": "application/json"})
            pace = Pace.from_settings()
            resp = conn.getresponse()
            body = read_capped(resp, cap=MAX_JSON_BYTES, pace=pace, what=f"POST {clean}")
        finally:
            conn.close()
        if resp.status >= 500:
            raise Retryable(f"HTTP {resp.status}")
        if resp.status >= 400:
            raise answer_error(resp.status, body, f"POST {clean}")
        return json.loads(body)

    tries = Retries(Backoff(retries, backoff, RETRY_CAP),
                    give_up=lambda e: ReshardError(f"POST {clean}: giving up after {retries} retries: {e}"))
    return tries.call(once, retry_on=(Retryable, OSError, http.client.HTTPException))


class PlannedBody:
    """The answer to `boxes` of a source planned here (no service between), read through a `RankStream`:
    the same bytes the service would send, nothing hashed (they come from the source, checked unchanged).
    `source` is a path or URL, or a source opened already (`reshard.io.source.opener.open_tensors`)."""

    def __init__(self, source: str | os.PathLike[str] | Source, boxes: Sequence[Box]) -> None:
        src = source if hasattr(source, "global_tensors") else open_tensors(source)  # type: ignore[arg-type]
        self.plan = plan_boxes(src, boxes, where=str(getattr(source, "root", source)))
        self.name = f"{getattr(source, 'root', source)} ({len(boxes)} boxes)"
        self.size, self.pos, self.verify = self.plan.size, 0, False
        self._stream = RankStream(self.plan)

    def readinto(self, view: memoryview) -> None:
        if self.pos + len(view) > self.size:
            raise IntegrityError(f"{self.name}: {self.size} bytes in the answer, asked for bytes up to "
                                 f"{self.pos + len(view)}")
        self._stream.read_into(self.pos, view)
        self.pos += len(view)

    def expected_sha256(self) -> str | None:
        return None

    def __iter__(self) -> Any:
        return chunks_of(self)

    def close(self) -> None:
        self._stream.close()


def is_service_url(source: str | os.PathLike[str]) -> bool:
    """Whether `source` is a checkpoint URL of `reshard serve` (`.../v1/checkpoints/NAME`), not a store's."""
    if not is_url(source):
        return False
    try:
        checkpoint_url(str(source))
    except ReshardError:
        return False
    return True


def open_boxes(source: str | os.PathLike[str] | Source, boxes: Sequence[Box], *, token: str | None = None,
               timeout: float = 60.0) -> BoxBody | PlannedBody:
    """The answer to `boxes` of `source`: the service's (`BoxBody`, one request) for its checkpoint URL,
    else planned and read here (`PlannedBody`) from a local path, a store prefix or an HTTP directory (or
    a source opened already)."""
    if not hasattr(source, "global_tensors") and is_service_url(source):  # type: ignore[arg-type]
        return BoxBody(str(source), boxes, token=token, timeout=timeout)
    return PlannedBody(source, boxes)


def tensor_listing(source: str | os.PathLike[str], *, token: str | None = None
                   ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, Any] | None, Source | None]:
    """(name -> (dtype, global shape) of every tensor of `source`, its config.json or None, the source
    opened here or None): from the service's description of its checkpoint URL (one GET), else from the
    headers read here (the opened source is returned, to plan boxes of without reading them again)."""
    if is_service_url(source):
        info = get_json(checkpoint_url(str(source)), token=token)
        return {t["name"]: (t["dtype"], tuple(t["shape"])) for t in info["tensors"]}, info.get("config"), None
    src = open_tensors(source)
    return {n: (gt.dtype, gt.shape) for n, gt in src.global_tensors().items()}, src.config, src
