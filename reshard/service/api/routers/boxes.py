"""Boxes: `POST /v1/checkpoints/{name}/boxes` with a JSON list of boxes, answered as one safetensors body.

A destination that knows what it holds (a DTensor's placements, torch DCP's read items) names the blocks
of the tensors it wants (`reshard.format.box_request`); the answer is planned like a rank's shard
(`reshard.plan.box_plan`) from whatever the checkpoint is (an HF checkpoint, rank files of any layout,
in a local root or a store) and streamed with the shards' guarantees (`planned_answer`): Content-Length
first, a strong ETag of the source files and the boxes, one `Range` (with `If-Range`) answered 206 so a
broken transfer resumes, the sha256 header once known (`.../boxes/digest` computes it). The request is
bounded before anything is planned: its body (`max_boxes_body_bytes`, 413), the number of boxes
(`max_boxes`), the bytes they cover (`max_box_bytes`) and the separate source runs they are made of
(`max_box_runs`), each 400 naming the limit; a box naming no tensor, past a tensor's end or asked for
twice is a 400 naming every such box (up to a few); a malformed body a 422. Everything that parses or
plans runs in worker threads.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from reshard.errors import BoxError
from reshard.format.box_request import BOXES_FORMAT, Box, boxes_digest
from reshard.plan.box_plan import plan_boxes
from reshard.plan.types import RankPlan
from reshard.service.api.deps import (
    CatalogDep,
    DigestsDep,
    MetricsDep,
    Name,
    Part,
    SettingsDep,
    StreamDep,
    off_loop,
)
from reshard.service.api.routers.shards import Conditions, planned_answer
from reshard.service.api.schemas import BoxesDigestOut, BoxesIn, inlined_schema
from reshard.service.catalog import Catalog, part_name
from reshard.service.http_errors import error_responses
from reshard.service.serve_settings import Settings
from reshard.service.transport.streaming import ShardResponse

router = APIRouter(prefix="/v1/checkpoints", tags=["boxes"])
ANSWER_NAME = "boxes.safetensors"

_DOC = """Blocks of the checkpoint's tensors as one safetensors file (`application/octet-stream`): an entry
per box, named by its tensor (`NAME[a:b,c:d]` where a tensor has several boxes), its `__metadata__`
saying which box each entry is. Only the source bytes the boxes cover are read.

* `Content-Length` is sent before the first byte; `ETag` (strong) names the source files and the boxes.
* `Range: bytes=a-` (one range; with `If-Range: ETAG` to resume a broken transfer) answers 206.
* `X-Reshard-Sha256` is sent once the digest is known (`POST .../boxes/digest` with the same body).
* Bounds: the body (`max_boxes_body_bytes`: 413), boxes per request (`max_boxes`), bytes (`max_box_bytes`),
  separate source runs (`max_box_runs`): 400 naming the limit, nothing read.
"""
_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": inlined_schema(BoxesIn)}}}}


async def _planned(request: Request, name: str, catalog: Catalog, settings: Settings) -> tuple[RankPlan, str, int]:
    """(the answer's plan, its digest, the number of boxes), every bound checked first."""
    body = await request.body()
    boxes = await off_loop(parse_request, body, settings.max_boxes)
    rp, digest = await off_loop(_plan, catalog, name, boxes, settings)
    return rp, digest, len(boxes)


def parse_request(body: bytes, max_boxes: int) -> list[Box]:
    """The boxes of a request body: 422 (`RequestValidationError`) for what is not `BoxesIn`, `BoxError`
    (400) for more than `max_boxes` boxes (counted before any box is validated)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestValidationError([{"loc": ("body",), "msg": f"not JSON: {e}", "type": "json_invalid"}]) from None
    listed = obj.get("boxes") if isinstance(obj, dict) else None
    if isinstance(listed, list) and len(listed) > max_boxes:
        raise BoxError(f"{len(listed)} boxes in one request, over the {max_boxes} this server answers "
                       "(max_boxes); split them over several requests")
    try:
        valid = BoxesIn.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_input=False)) from None
    return [Box(b.name, b.offsets, b.sizes) for b in valid.boxes]


def _plan(catalog: Catalog, name: str, boxes: list[Box], settings: Settings) -> tuple[RankPlan, str]:
    ckpt, _ = catalog.opened(name)
    rp = plan_boxes(ckpt, boxes, max_bytes=settings.max_box_bytes, max_runs=settings.max_box_runs,
                    where=f"checkpoint {name!r}")
    blob = json.dumps({"source": ckpt.identity(), "boxes": boxes_digest(boxes), "format": BOXES_FORMAT},
                      sort_keys=True, separators=(",", ":"))
    return rp, hashlib.sha256(blob.encode()).hexdigest()


def boxes_etag(digest: str) -> str:
    """Strong ETag of an answer: the digest covers the source files' identity and the boxes."""
    return f'"{digest[:40]}-b"'


_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "the boxes as one safetensors file"},
    206: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "the requested byte range of it"},
    **error_responses(400, 401, 404, 409, 413, 416, 422),
}


async def post_boxes(request: Request, name: Name, catalog: CatalogDep, digests: DigestsDep, ctx: StreamDep,
                     settings: SettingsDep, part: Part = None) -> Response:
    asked = Conditions.of(request, conditional=False)
    rp, digest, _ = await _planned(request, part_name(name, part), catalog, settings)
    return planned_answer(asked, rp, etag=boxes_etag(digest), plan_digest=digest, digests=digests, ctx=ctx,
                          filename=ANSWER_NAME)


async def post_boxes_digest(request: Request, name: Name, catalog: CatalogDep, digests: DigestsDep, ctx: StreamDep,
                            settings: SettingsDep, metrics: MetricsDep, part: Part = None) -> BoxesDigestOut:
    rp, digest, count = await _planned(request, part_name(name, part), catalog, settings)
    etag = boxes_etag(digest)
    sha, cached = await anyio.to_thread.run_sync(lambda: digests.compute(etag, rp, chunk_size=ctx.chunk_size),
                                                 limiter=ctx.limiter())
    metrics.digests.labels("hit" if cached else "miss").inc()
    return BoxesDigestOut(boxes=count, size=rp.size, etag=etag, sha256=sha, cached=cached)


for _path, _what in (("/{name}/boxes", ""), ("/{name}/{part}/boxes", "_part")):
    of = " of a training checkpoint's optimizer state" if _what else ""
    router.add_api_route(_path, post_boxes, methods=["POST"], response_class=ShardResponse, openapi_extra=_BODY,
                         operation_id=f"post{_what}_boxes", summary=f"Blocks of tensors{of} (safetensors bytes)",
                         description=_DOC, responses=_ANSWERS)
    router.add_api_route(_path + "/digest", post_boxes_digest, methods=["POST"], response_model=BoxesDigestOut,
                         openapi_extra=_BODY, operation_id=f"post{_what}_boxes_digest",
                         summary=f"sha256 of the answer to the same boxes{of}",
                         description="Computed by streaming the answer once per ETag, then cached (also filled by "
                         "the first full download of it).", responses=error_responses(400, 401, 404, 409, 413, 422))
