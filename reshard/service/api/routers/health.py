"""`GET /healthz` (and `HEAD /healthz`, for probes that only look at the status): liveness, never
behind the token."""

from __future__ import annotations

from fastapi import APIRouter

import reshard
from reshard.service.api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness check (no token needed)")
def healthz() -> Health:
    return Health(version=reshard.__version__)


# HEAD answers as GET does, without the body (uvicorn drops it); kept out of the OpenAPI document,
# which would otherwise list the same operation twice
router.add_api_route("/healthz", healthz, methods=["HEAD"], response_model=Health, include_in_schema=False)
