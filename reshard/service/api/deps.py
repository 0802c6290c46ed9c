"""Accessors for the long-lived state `create_app` puts on `app.state`, as FastAPI dependencies, and
`off_loop`, which routes use for all that plans or validates rules."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import anyio.to_thread
from fastapi import Depends, Path, Query, Request
from fastapi.exceptions import RequestValidationError

from reshard.layout.mesh import DIMENSIONS, MAX_WORLD, Layout
from reshard.rules.engines import known_engines
from reshard.service.api.schemas import NAME_PATTERN
from reshard.service.catalog import PARTS, Catalog
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


_CANONICAL = re.compile(r"[1-9][0-9]{0,8}")


def layout_query(request: Request, **sizes: int) -> Layout:
    """The layout a request names: `?tp=`, `pp`, `fsdp`, `ep`, `dp_replicate` (each 1 unless given); an
    impossible one (ep not a multiple of tp, ...) is a 422 naming the rule, and so is a size given twice
    or not written as a plain decimal (`2.0`, `+2`, ` 2`, `02`: one request names one layout, one way)."""
    for d in DIMENSIONS:
        given = request.query_params.getlist(d.name)
        if len(given) > 1 or (given and not _CANONICAL.fullmatch(given[0])):
            why = f"given {len(given)} times" if len(given) > 1 else f"{given[0]!r} is not a plain decimal"
            raise RequestValidationError([{"type": "value_error", "loc": ("query", d.name), "input": given,
                                           "msg": f"{why}; give it once, as digits (e.g. {d.name}=2)"}])
    return Layout.from_sizes(sizes)


# one query parameter per parallel dimension (`reshard.layout.mesh.DIMENSIONS`), as FastAPI reads a signature
layout_query.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request)] +
    [inspect.Parameter(d.name, inspect.Parameter.KEYWORD_ONLY, default=d.default,
                       annotation=Annotated[int, Query(ge=1, le=MAX_WORLD, description=d.help)]) for d in DIMENSIONS],
    return_annotation=Layout)


LayoutDep = Annotated[Layout, Depends(layout_query)]
# `/{name}/{part}/shards/...`: a training checkpoint's optimizer state (`reshard.service.catalog.PARTS`)
Part = Literal[PARTS] | None  # type: ignore[valid-type]
Rules = Annotated[str | None, Query(description="label of a stored manifest to use instead",
                                    json_schema_extra=_NAME_DOC)]
# the engines of `reshard.rules.engines`' registry (as the CLI's --engine choices); another name is a 422
Engine = Annotated[Literal[tuple(known_engines())] | None, Query(  # type: ignore[valid-type]
    description="cut each rank the way an inference engine holds it (`vllm`: its vocabulary split, docs/vllm.md)")]
Label = Annotated[str, Query(description="label to store the manifest under", json_schema_extra=_NAME_DOC)]
