"""`create_app(settings)`: the FastAPI app that serves rank shards of the checkpoints under a root.

Long-lived state lives on `app.state`: `settings`, `catalog` (parsed checkpoints and plans, cached
by stat identity), `digests` (shard sha256 by ETag), `jobs` (background writes), `metrics` and
`stream_context`; what several worker processes must agree on (jobs, digests) is in the SQLite
`StateDB` they all open (a cache for digests: downloads never depend on it), and metrics are summed across them (`reshard.service.prometheus`). Middleware is pure ASGI (metrics outermost, then the optional bearer token) so shard
bodies stream through untouched.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI
from fastapi.security import HTTPBearer
from fastapi_offline import FastAPIOffline

import reshard
from reshard.io.source import store_cache
from reshard.io.source.stores import FETCH_HOOKS
from reshard.service.api.middleware import (
    DOC_ASSETS,
    DOC_PATHS,
    PUBLIC_PATHS,
    BearerAuth,
    BodyLimit,
    RequestMetrics,
)
from reshard.service.api.routers import boxes, checkpoints, health, jobs, meta, metrics, shards
from reshard.service.api.uploads import remove_dead_uploads
from reshard.service.catalog import Catalog
from reshard.service.http_errors import install_error_handlers
from reshard.service.jobs.digests import DigestCache
from reshard.service.jobs.runner import JobManager
from reshard.service.jobs.state import StateDB
from reshard.service.process.lifecycle import stop_on_signals
from reshard.service.prometheus import ServiceMetrics
from reshard.service.serve_settings import Settings
from reshard.service.store_catalog import StoreCatalog
from reshard.service.transport.gathered import GatherCache
from reshard.service.transport.pump import DIRECT_MIN
from reshard.service.transport.streaming import StreamContext

DESCRIPTION = """Tensor-parallel workers pull exactly their own shard of a checkpoint that lives only on
this server, computed on the fly from the unmodified full checkpoint.

Checkpoints are the directories under the server's root. Every endpoint except `/healthz` needs
`Authorization: Bearer TOKEN` when the server was started with a token: on /docs, **Authorize**
with it to try them. Errors answer `{"error": ..., "detail": ...}` with a 4xx status."""

# /docs and /redoc load Swagger UI and ReDoc from the service itself (the files fastapi-offline ships),
# never from a CDN, so the page works on an offline cluster; no online validator badge either
SWAGGER_UI = {"validatorUrl": None}

TAGS = [
    {"name": "checkpoints", "description": "What is served, its manifest, uploads."},
    {"name": "shards", "description": "Rank shards as safetensors bytes; their digests."},
    {"name": "boxes", "description": "Blocks of tensors a client names, as safetensors bytes; their digests."},
    {"name": "jobs", "description": "Write rank files into the output directory in the background."},
    {"name": "metrics", "description": "Prometheus metrics."},
    {"name": "health", "description": "Liveness."},
]


def _is_upload(path: str) -> bool:
    """`PUT /v1/checkpoints/{name}/files/{filename}` streams to disk under `max_upload_bytes`."""
    parts = path.split("/")
    return len(parts) == 6 and parts[1:3] == ["v1", "checkpoints"] and parts[4] == "files"


_BOXES_TAILS = [["boxes"], ["boxes", "digest"], ["optimizer", "boxes"], ["optimizer", "boxes", "digest"]]


def _is_boxes(path: str) -> bool:
    """`POST /v1/checkpoints/{name}[/optimizer]/boxes[/digest]`: a list of boxes, under `max_boxes_body_bytes`."""
    parts = path.split("/")
    return parts[1:3] == ["v1", "checkpoints"] and parts[4:] in _BOXES_TAILS


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; `settings` default to the `RESHARD_*` environment."""
    settings = settings if settings is not None else Settings()  # type: ignore[call-arg]
    if isinstance(settings.root, str):  # a root in a store
        catalog: Catalog = StoreCatalog(settings)
    else:
        catalog = Catalog(settings)
    # the shared state never keeps a worker from starting: a store that fails answers 503/507 on the job
    # routes until it works again; a worker that starts cleans up after workers that were killed
    state = StateDB(settings.jobs_dir, max_digests=settings.digest_cache)
    digests = DigestCache(min(settings.digest_cache, 1024), state)
    job_manager = JobManager(settings, catalog, digests, state)
    if isinstance(settings.root, Path):
        remove_dead_uploads(settings.root)
    service_metrics = ServiceMetrics(job_counts=job_manager.counts)

    if isinstance(settings.root, str):  # every range of the store's objects fetched once per node
        cache = store_cache.enable(settings.store_cache_path, settings.store_cache, block=settings.store_cache_block)
        if cache is not None:
            cache.on_hit = service_metrics.store_cache_hits.inc

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        restore = stop_on_signals(job_manager.stop)  # write jobs stop at once, not after the downloads
        FETCH_HOOKS.append(service_metrics.store_fetched.inc)
        try:
            yield
        finally:
            FETCH_HOOKS.remove(service_metrics.store_fetched.inc)
            restore()
            job_manager.shutdown()

    app = FastAPIOffline(title="reshard", version=reshard.__version__, description=DESCRIPTION, openapi_tags=TAGS,
                         lifespan=lifespan, static_url=DOC_ASSETS, swagger_ui_parameters=SWAGGER_UI)
    app.state.settings = settings
    app.state.catalog = catalog
    app.state.digests = digests
    app.state.jobs = job_manager
    app.state.metrics = service_metrics
    gathered = GatherCache.create(settings.gathered_dir, settings.gather_cache, DIRECT_MIN) if settings.zero_copy else None
    app.state.stream_context = StreamContext(service_metrics, settings.chunk_size, settings.io_threads,
                                              settings.send_timeout, gathered)
    install_error_handlers(app)

    # the token is checked by middleware (one place, every route); this declares it in the OpenAPI doc
    bearer = HTTPBearer(auto_error=False, description="the server's --token (RESHARD_TOKEN)")
    secured = [] if settings.token is None else [Depends(bearer)]
    app.include_router(health.router)
    for module in (checkpoints, meta, shards, boxes, jobs, metrics):
        app.include_router(module.router, dependencies=secured)

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, exempt=lambda p: _is_upload(p) or _is_boxes(p))
    app.add_middleware(BodyLimit, limit=settings.max_boxes_body_bytes, exempt=lambda p: not _is_boxes(p))
    if settings.token is not None:
        public = PUBLIC_PATHS | DOC_PATHS if settings.public_docs else PUBLIC_PATHS
        app.add_middleware(BearerAuth, token=settings.token.get_secret_value(), public=public,
                           public_prefixes=(DOC_ASSETS + "/",) if settings.public_docs else ())
    app.add_middleware(RequestMetrics, metrics=service_metrics)
    return app
