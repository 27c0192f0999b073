"""Liveness, readiness (etcd quorum) and Prometheus metrics; no token needed."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.deps import ContextDep
from service.api.errors import ApiError, error_responses
from service.api.schemas import Health, Readiness

router = APIRouter(tags=["health"])
_PUBLIC: dict[str, Any] = {"security": []}  # no token: probes and scrapers have none
_PROMETHEUS = {
    "description": "Prometheus text exposition format",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}


@router.get("/healthz", response_model=Health, openapi_extra=_PUBLIC)
def healthz() -> dict[str, str]:
    """The process serves requests."""
    return {"status": "ok"}


@router.get("/readyz", response_model=Readiness, responses=error_responses(503), openapi_extra=_PUBLIC)
def readyz(ctx: ContextDep) -> dict[str, Any]:
    """Ready while etcd answers a linearizable read (it has quorum) and, on the leader, while
    the reconciler completes its passes."""
    if not ctx.jobs.store.healthy():
        raise ApiError(
            503, "not_ready", "etcd does not answer (no quorum or unreachable); check the etcd members"
        )
    stalled = ctx.stalled()
    if stalled is not None:
        raise ApiError(503, "not_ready", stalled)
    return {"ready": True, "leader": ctx.leader()}


@router.get("/metrics", response_class=Response, responses={200: _PROMETHEUS}, openapi_extra=_PUBLIC)
def metrics(ctx: ContextDep) -> Response:
    """The service's Prometheus metrics."""
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
