"""`GET /metrics`: Prometheus text exposition (all worker processes together)."""

from __future__ import annotations

from fastapi import APIRouter, Response

from reshard.service.api.deps import MetricsDep
from reshard.service.http_errors import error_responses
from reshard.service.prometheus import CONTENT_TYPE

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    description="Requests by route and status, shard bytes served, active streams, stream durations, "
    "digests, uploads and jobs by state, in the Prometheus text format 0.0.4, summed over the server's "
    "worker processes.",
    responses={200: {"content": {"text/plain": {}}}, **error_responses(401)},
)
def metrics(m: MetricsDep) -> Response:
    return Response(m.render(), media_type=CONTENT_TYPE)
