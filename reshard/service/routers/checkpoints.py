"""Checkpoints: list, describe, plan, store a manifest, upload a file."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from pydantic import Field

from reshard.plan.types import MAX_TP, plan_to_json
from reshard.rules.manifest import Manifest
from reshard.service.catalog import DEFAULT_LABEL
from reshard.service.deps import TP, CatalogDep, Label, MetricsDep, Name, Rules, SettingsDep
from reshard.service.errors import error_responses
from reshard.service.ranges import shard_etag
from reshard.service.schemas import (
    CheckpointList,
    CheckpointOut,
    ManifestIn,
    PlanOut,
    RulesOut,
    StoredRulesOut,
    UploadOut,
)
from reshard.service.uploads import receive_upload

router = APIRouter(prefix="/v1/checkpoints", tags=["checkpoints"])
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
    "source, header size and (unless `tensors=false`) every output tensor with its source selection.",
    responses=error_responses(400, 401, 404, 422),
)
def get_plan(name: Name, tp: TP, catalog: CatalogDep, rules: Rules = None,
             tensors: Annotated[bool, Query(description="list every tensor of every rank")] = True) -> dict[str, Any]:
    src = catalog.source(name, rules=rules)
    plan = catalog.plan(src, tp)
    out = plan_to_json(plan, tensors=tensors)
    for entry in out["ranks"]:
        entry["etag"] = shard_etag(plan.digest, entry["rank"])
    return out


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
def put_rules(name: Name, body: ManifestIn, catalog: CatalogDep,
              label: Label = DEFAULT_LABEL,
              tp: Annotated[list[Annotated[int, Field(ge=1, le=MAX_TP)]] | None,
                            Query(description="degrees that must plan", max_length=64)] = None
              ) -> dict[str, Any]:
    manifest = Manifest.from_dict(body.to_obj(), source=f"stored manifest {label!r}")
    return catalog.store_rules(name, manifest, label=label, tps=tp or ())


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
