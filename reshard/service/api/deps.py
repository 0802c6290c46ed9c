"""Accessors for the long-lived state `create_app` puts on `app.state`, as FastAPI dependencies, and
`off_loop`, which routes use for all that plans or validates rules."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import anyio.to_thread
from fastapi import Depends, Path, Query, Request

from reshard.layout.mesh import MAX_WORLD, Layout
from reshard.plan.types import MAX_TP
from reshard.service.api.schemas import NAME_PATTERN
from reshard.service.catalog import Catalog
from reshard.service.jobs.digests import DigestCache
from reshard.service.jobs.runner import JobManager
from reshard.service.prometheus import ServiceMetrics
from reshard.service.serve_settings import Settings
from reshard.service.transport.streaming import StreamContext

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in a worker thread (anyio's pool, the one FastAPI runs `def` routes in):
    reading checkpoints, deriving or validating rules and planning never run on the event loop, which
    meanwhile answers /healthz and feeds the streams. (What used to stall a worker whole was Python's
    `re` backtracking with the GIL held; rules now match on RE2: `reshard.rules.patterns`.)"""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_catalog(request: Request) -> Catalog:
    return request.app.state.catalog


def get_jobs(request: Request) -> JobManager:
    return request.app.state.jobs


def get_metrics(request: Request) -> ServiceMetrics:
    return request.app.state.metrics


def get_digests(request: Request) -> DigestCache:
    return request.app.state.digests


def get_stream_context(request: Request) -> StreamContext:
    return request.app.state.stream_context


CatalogDep = Annotated[Catalog, Depends(get_catalog)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
JobsDep = Annotated[JobManager, Depends(get_jobs)]
MetricsDep = Annotated[ServiceMetrics, Depends(get_metrics)]
DigestsDep = Annotated[DigestCache, Depends(get_digests)]
StreamDep = Annotated[StreamContext, Depends(get_stream_context)]

# documented, not enforced by FastAPI: `reshard.service.catalog.check_name` answers 400 with an explanation
_NAME_DOC = {"pattern": NAME_PATTERN, "maxLength": 128}
Name = Annotated[str, Path(description="checkpoint directory name under the root (no '..', no separators)",
                           json_schema_extra=_NAME_DOC)]
TP = Annotated[int, Query(ge=1, le=MAX_TP, description="tensor-parallel degree (1 unless given)")]
Size = Annotated[int, Query(ge=1, le=MAX_WORLD)]


def layout_query(tp: TP = 1, pp: Annotated[Size, Query(description="pipeline stages")] = 1,
                 fsdp: Annotated[Size, Query(description="FSDP shards of every parameter")] = 1,
                 ep: Annotated[Size, Query(description="expert-parallel degree")] = 1,
                 dp_replicate: Annotated[Size, Query(description="data-parallel replicas (HSDP)")] = 1) -> Layout:
    """The layout a request names: `?tp=`, `pp`, `fsdp`, `ep`, `dp_replicate` (each 1 unless given); an
    impossible one (ep not a multiple of tp, ...) is a 422 naming the rule."""
    return Layout(tp=tp, pp=pp, fsdp=fsdp, ep=ep, dp_replicate=dp_replicate)


LayoutDep = Annotated[Layout, Depends(layout_query)]
Rules = Annotated[str | None, Query(description="label of a stored manifest to use instead",
                                    json_schema_extra=_NAME_DOC)]
Engine = Annotated[Literal["vllm"] | None, Query(
    description="cut each rank the way an inference engine holds it (`vllm`: its vocabulary split, docs/vllm.md)")]
Label = Annotated[str, Query(description="label to store the manifest under", json_schema_extra=_NAME_DOC)]
