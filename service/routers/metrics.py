"""`GET /metrics`: Prometheus text exposition."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from service.deps import MetricsDep
from service.errors import error_responses
from service.metrics import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    summary="Prometheus metrics",
    description="Requests by route and status, shard bytes served, active streams, stream durations, "
    "digests, uploads and jobs by state, in the Prometheus text format 0.0.4.",
    responses={200: {"content": {"text/plain": {}}}, **error_responses(401)},
)
def metrics(m: MetricsDep) -> PlainTextResponse:
    return PlainTextResponse(m.render(), media_type=CONTENT_TYPE)
