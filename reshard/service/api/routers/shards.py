"""Rank shards: `GET`/`HEAD /v1/checkpoints/{name}/shards/{rank}?tp=N` and its sha256 digest.

The body is the rank's safetensors file, byte-identical to `reshard write`'s, computed on the fly
from the unmodified checkpoint. `Content-Length` comes first, the ETag names the plan (source
identity, manifest, tp) and the rank, single byte ranges answer 206 and `If-None-Match` 304.
`get_shard` is a `def` route (FastAPI runs it in its thread pool: planning stays off the event loop);
the digest route hands its planning and hashing to worker threads itself. `/{name}/optimizer/shards/...`
serves a training checkpoint's optimizer state (its `optimizer/` rank files) the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Header, Path, Request, Response

from reshard.format.rank_file import rank_file_name
from reshard.plan.types import RankPlan
from reshard.service.api.deps import (
    CatalogDep,
    DigestsDep,
    Engine,
    LayoutDep,
    MetricsDep,
    Name,
    Part,
    Rules,
    StreamDep,
)
from reshard.service.api.schemas import DigestOut
from reshard.service.catalog import part_name
from reshard.service.http_errors import error_responses
from reshard.service.jobs.digests import DigestCache
from reshard.service.transport.ranges import etag_matches, list_header, parse_range, shard_etag, single_header
from reshard.service.transport.streaming import SHA_HEADER, ShardResponse, StreamContext

router = APIRouter(prefix="/v1/checkpoints", tags=["shards"])

Rank = Annotated[int, Path(ge=0, le=4095, description="global rank, 0..world-1 (world = pp x dp_replicate x fsdp x tp)")]

_SHARD_DOC = """The rank's safetensors file (`application/octet-stream`), streamed from the full checkpoint.

* `Content-Length` is sent before the first byte; `HEAD` sends the same headers and no body.
* `ETag` (strong) identifies source files, manifest, tp and rank; `If-None-Match` answers 304.
* `Range: bytes=a-b` (one range) answers 206 with `Content-Range`; a range past the end answers 416;
  several ranges in one field, or a malformed one, are ignored (200, the whole file). Two `Range` (or
  `If-Range`) header lines answer 400: the field may appear once (RFC 9110 section 5.3).
  `If-Range` with a different ETag answers 200 with the whole file.
* `X-Reshard-Sha256` is sent once the digest is known (see `.../digest`); the first full download
  of a shard computes it on the way, so a client asking for it afterwards gets it at once.
"""


def get_shard(
    request: Request, name: Name, rank: Rank, layout: LayoutDep, catalog: CatalogDep, digests: DigestsDep, ctx: StreamDep,
    rules: Rules = None, engine: Engine = None, part: Part = None,
    range_: Annotated[str | None, Header(alias="range")] = None,
    if_range: Annotated[str | None, Header()] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    asked = Conditions.of(request)
    src = catalog.source(part_name(name, part), rules=rules, engine=engine)
    digest, rp = catalog.rank_plan(src, layout, rank)
    return planned_answer(asked, rp, etag=shard_etag(digest, rank), plan_digest=digest, digests=digests, ctx=ctx,
                          filename=rank_file_name(rank, layout.world))


@dataclass(frozen=True)
class Conditions:
    """What a request asks of a streamed answer: `Range`, `If-Range`, `If-None-Match` (None: not sent)."""

    method: str
    range_: str | None
    if_range: str | None
    if_none_match: str | None

    @classmethod
    def of(cls, request: Request, *, conditional: bool = True) -> Conditions:
        """From every header line the client sent (two lines of `Range` or `If-Range`: 400); `If-None-Match`
        only where `conditional`."""
        return cls(request.method, single_header(request.headers, "range"), single_header(request.headers, "if-range"),
                   list_header(request.headers, "if-none-match") if conditional else None)


def planned_answer(asked: Conditions, rp: RankPlan, *, etag: str, plan_digest: str, digests: DigestCache,
                   ctx: StreamContext, filename: str) -> Response:
    """The answer that streams `rp`'s file (a rank's shard, or the boxes of `reshard.service.api.routers.boxes`):
    `Content-Length`, `ETag`, one `Range` (with `If-Range`) answered 206, `If-None-Match` 304, the sha256
    header once it is known; a whole body read fills the digest cache."""
    range_, if_range, if_none_match, head = asked.range_, asked.if_range, asked.if_none_match, asked.method == "HEAD"
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'attachment; filename="{filename}"',
        "X-Reshard-Plan": plan_digest,
    }
    sha = digests.get(etag)
    if sha is not None:
        headers[SHA_HEADER] = sha
    if etag_matches(if_none_match, etag):
        return Response(status_code=304, headers=headers)
    span = None
    if range_ is not None and (if_range is None or if_range.strip() == etag):
        span = parse_range(range_, rp.size)
    if span is None:
        fill = (lambda sha256: digests.put(etag, sha256)) if sha is None else None
        return ShardResponse(rp, ctx=ctx, headers=headers, head=head, on_digest=fill)
    start, end = span
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{rp.size}"
    return ShardResponse(rp, ctx=ctx, start=start, end=end, status_code=206, headers=headers, head=head)


_SHARD_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "the whole rank file"},
    206: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
          "description": "the requested byte range"},
    304: {"description": "not modified (If-None-Match matched the ETag)"},
    **error_responses(400, 401, 404, 409, 416, 422),
}
for _method in ("GET", "HEAD"):
    for _path, _what in (("/{name}/shards/{rank}", ""), ("/{name}/{part}/shards/{rank}", "_part")):
        router.add_api_route(
            _path, get_shard, methods=[_method], response_class=ShardResponse,
            operation_id=f"{_method.lower()}{_what}_shard", summary="One rank's shard (safetensors bytes)"
            + (" of a training checkpoint's optimizer state" if _what else "")
            + (", headers only" if _method == "HEAD" else ""), description=_SHARD_DOC, responses=_SHARD_RESPONSES,
        )


@router.get(
    "/{name}/{part}/shards/{rank}/digest",
    response_model=DigestOut,
    summary="sha256 of one rank's shard of a training checkpoint's optimizer state",
    responses=error_responses(400, 401, 404, 409, 422),
)
@router.get(
    "/{name}/shards/{rank}/digest",
    response_model=DigestOut,
    summary="sha256 of one rank's shard",
    description="Computed by streaming the shard once per ETag, then cached in memory (also filled by "
    "write jobs and by the first full download of the shard). Clients compare it with what they received.",
    responses=error_responses(400, 401, 404, 409, 422),
)
async def get_digest(name: Name, rank: Rank, layout: LayoutDep, catalog: CatalogDep, digests: DigestsDep,
                     ctx: StreamDep, metrics: MetricsDep, rules: Rules = None, engine: Engine = None,
                     part: Part = None) -> DigestOut:
    src = await anyio.to_thread.run_sync(lambda: catalog.source(part_name(name, part), rules=rules, engine=engine))
    digest, rp = await anyio.to_thread.run_sync(catalog.rank_plan, src, layout, rank)
    etag = shard_etag(digest, rank)
    sha, cached = await anyio.to_thread.run_sync(
        lambda: digests.compute(etag, rp, chunk_size=ctx.chunk_size), limiter=ctx.limiter())
    metrics.digests.labels("hit" if cached else "miss").inc()
    return DigestOut(rank=rank, tp=layout.tp, size=rp.size, etag=etag, sha256=sha, cached=cached)
