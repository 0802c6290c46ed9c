"""Checkpoints: list, describe, plan, store a manifest, upload a file.

What plans or validates rules runs in worker threads: the `def` routes in FastAPI's pool, the `async`
ones through `off_loop`; the JSON plan is streamed rank by rank, so a worker's memory does not grow
with tp (a tp=4096 plan of a small checkpoint is tens of MB of JSON).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import Field

from reshard.plan.planner import LayoutPlanner
from reshard.plan.types import MAX_TP, Plan, plan_head, plan_to_json
from reshard.rules.manifest import Manifest
from reshard.service.api.deps import (
    CatalogDep,
    Engine,
    Label,
    LayoutDep,
    MetricsDep,
    Name,
    Rules,
    SettingsDep,
    off_loop,
)
from reshard.service.api.schemas import (
    CheckpointList,
    CheckpointOut,
    ManifestIn,
    PlanOut,
    RulesOut,
    StoredRulesOut,
    UploadOut,
)
from reshard.service.api.uploads import receive_upload
from reshard.service.catalog import DEFAULT_LABEL, plan_ranks_once
from reshard.service.http_errors import BadRequest, error_responses
from reshard.service.transport.ranges import shard_etag

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"])
MAX_LISTED = 1 << 20  # tensor entries (tp x tensors) one JSON plan lists
MAX_DEGREES = 8  # distinct tp values one `PUT .../rules?tp=` validates
_BATCH = 4096  # tensor entries planned and rendered per worker-thread call
FILE_PATTERN = r"^([A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*\.safetensors|config\.json|model\.safetensors\.index\.json)$"


@router.get("", response_model=CheckpointList, summary="Checkpoint directories under the root",
            responses=error_responses(401))
def list_checkpoints(catalog: CatalogDep) -> dict[str, Any]:
    return {"checkpoints": catalog.names()}


@router.get(
    "/{name}",
    response_model=CheckpointOut,
    summary="Files, tensors (dtype, shape, bytes), config.json and the manifest that applies",
    responses=error_responses(400, 401, 404, 422),
)
def get_checkpoint(name: Name, catalog: CatalogDep, rules: Rules = None) -> dict[str, Any]:
    return catalog.describe(name, rules=rules)


@router.get(
    "/{name}/plan",
    response_model=PlanOut,
    summary="The plan of every rank for `tp` (from headers alone)",
    description="Per rank: file name, ETag of its shard, bytes, replicated bytes, bytes read from the "
    "source, header size and (unless `tensors=false`) every output tensor with its source selection. "
    "The answer is streamed rank by rank (planned as it is sent, every rank checked before the first "
    f"byte); with `tensors=true`, tp x tensors may be at most {MAX_LISTED} (400 beyond: ask with "
    "`tensors=false`, or for one rank's shard headers).",
    responses=error_responses(400, 401, 404, 422),
)
async def get_plan(name: Name, layout: LayoutDep, catalog: CatalogDep, rules: Rules = None, engine: Engine = None,
                   tensors: Annotated[bool, Query(description="list every tensor of every rank")] = True) -> Response:
    src = await off_loop(catalog.source, name, rules=rules, engine=engine)
    count, world = len(src.ckpt.global_tensors()), layout.world
    if tensors and world * count > MAX_LISTED:
        at = f"tp={world}" if layout.tp_only else f"{layout.describe()} ({world} ranks)"
        raise BadRequest(
            f"the plan of {name!r} at {at} would list {world} x {count} = {world * count} tensors, over the "
            f"{MAX_LISTED} one answer lists; ask with tensors=false (each rank's totals), for a smaller tp, "
            "or for one rank (HEAD .../shards/RANK?tp=N)")
    catalog.check_work(src, layout, world, what="the plan")
    plan, planner = await off_loop(catalog.planner, src, layout)
    per = max(1, _BATCH // max(1, count if tensors else 16))
    return StreamingResponse(_plan_json(plan, planner, tensors=tensors, per=per), media_type="application/json")


def _dumps(obj: Any) -> bytes:
    """As FastAPI's JSONResponse renders."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def _ranks_json(plan: Plan, planner: LayoutPlanner, ranks: range, *, tensors: bool) -> bytes:
    """`plan_to_json`'s entries of `ranks` (with their ETags), comma-joined, each rank's plan dropped once written."""
    out = []
    for rp in plan_ranks_once(planner, ranks):
        entry = plan_to_json(dataclasses.replace(plan, ranks=(rp,)), tensors=tensors)["ranks"][0]
        head = {"rank": entry.pop("rank"), "file": entry.pop("file"), "etag": shard_etag(plan.digest, rp.rank)}
        listed = entry.get("tensors")
        if not isinstance(listed, list):
            out.append(_dumps({**head, **entry}))
            continue
        # the tensors a few hundred at a time: json's encoder holds the GIL for a whole call
        entry["tensors"] = None
        first, rest = _dumps({**head, **entry}).split(b'"tensors":null', 1)
        pieces = [_dumps(listed[i : i + 256])[1:-1] for i in range(0, len(listed), 256)]
        out.append(first + b'"tensors":[' + b",".join(pieces) + b"]" + rest)
    return b",".join(out)


async def _plan_json(plan: Plan, planner: LayoutPlanner, *, tensors: bool, per: int) -> AsyncIterator[bytes]:
    """The `PlanOut` JSON, a batch of `per` ranks at a time, each planned in a worker thread."""
    yield _dumps(plan_head(plan))[:-1] + b',"ranks":['
    for start in range(0, plan.world, per):
        batch = range(start, min(start + per, plan.world))
        body = await off_loop(_ranks_json, plan, planner, batch, tensors=tensors)
        yield (b"," + body) if start else body
    yield b"]}"


@router.get(
    "/{name}/rules",
    response_model=RulesOut,
    summary="The manifest that applies (or the stored one named by `label`)",
    responses=error_responses(400, 401, 404, 422),
)
def get_rules(name: Name, catalog: CatalogDep, label: Rules = None) -> dict[str, Any]:
    return catalog.rules_info(name, rules=label)


@router.put(
    "/{name}/rules",
    response_model=StoredRulesOut,
    summary="Store a manifest for this checkpoint",
    description="Validated against the checkpoint (every kind known, every rule's options apply to the "
    "tensors it matches; with `tp`, those degrees must plan too), then stored under `label`. The label "
    f"`{DEFAULT_LABEL}` takes precedence over a rules file and config.json; other labels are chosen with "
    "`?rules=LABEL` on the other endpoints.",
    responses=error_responses(400, 401, 404, 413, 422),
)
async def put_rules(name: Name, body: ManifestIn, catalog: CatalogDep,
                    label: Label = DEFAULT_LABEL,
                    tp: Annotated[list[Annotated[int, Field(ge=1, le=MAX_TP)]] | None,
                                  Query(description=f"degrees that must plan: at most {MAX_DEGREES}, adding up "
                                        f"to at most {MAX_TP} ranks")] = None
                    ) -> dict[str, Any]:
    tps = validated_degrees(tp or ())
    manifest = await off_loop(Manifest.from_dict, body.to_obj(), source=f"stored manifest {label!r}")
    return await off_loop(catalog.store_rules, name, manifest, label=label, tps=tps)


def validated_degrees(tps: Sequence[int]) -> tuple[int, ...]:
    """The distinct degrees `PUT .../rules?tp=` plans, bounded so that one request plans no more ranks
    than the largest plan (tp=MAX_TP) does; BadRequest beyond."""
    distinct = tuple(sorted(set(tps)))
    if len(distinct) > MAX_DEGREES or sum(distinct) > MAX_TP:
        raise BadRequest(f"tp={','.join(map(str, distinct))}: {len(distinct)} degrees of {sum(distinct)} ranks in "
                         f"all; one request validates at most {MAX_DEGREES} degrees of at most {MAX_TP} ranks in "
                         "all: send the others in another request")
    return distinct


@router.put(
    "/{name}/files/{filename}",
    response_model=UploadOut,
    summary="Upload a checkpoint file (raw body)",
    description="The body is streamed to a temp file beside the checkpoint, checked (a safetensors header "
    "consistent with the file's size, or a JSON config / index) and published with one rename; nothing is "
    "published on any failure. Accepted names: NAME.safetensors, config.json, model.safetensors.index.json. "
    "A new name creates the checkpoint directory.",
    openapi_extra={"requestBody": {"required": True, "content": {
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
    responses=error_responses(400, 401, 409, 413, 422, 503, 507),
)
async def put_file(name: Name, filename: Annotated[str, Path(json_schema_extra={"pattern": FILE_PATTERN})],
                   request: Request,
                   catalog: CatalogDep, settings: SettingsDep, metrics: MetricsDep, response: Response
                   ) -> dict[str, Any]:
    length = request.headers.get("content-length")
    try:
        result = await receive_upload(
            catalog, name, filename, request.stream(),
            content_length=int(length) if length and length.isdigit() else None,
            max_bytes=settings.max_upload_bytes,
        )
    except BaseException:
        metrics.uploads.labels("refused").inc()
        raise
    metrics.uploads.labels("published").inc()
    response.status_code = 200 if result["replaced"] else 201
    return result
