"""`GET /healthz`: liveness, never behind the token."""

from __future__ import annotations

from fastapi import APIRouter

import reshard
from reshard.service.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness check (no token needed)")
def healthz() -> Health:
    return Health(version=reshard.__version__)
