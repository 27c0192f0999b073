"""Liveness, readiness (etcd quorum) and Prometheus metrics; no token needed."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST

from service.api.deps import ContextDep
from service.api.errors import ApiError

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process serves requests."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "etcd has no quorum or cannot be reached"}})
def readyz(ctx: ContextDep) -> dict[str, Any]:
    """Ready while etcd answers a linearizable read (it has quorum)."""
    if not ctx.jobs.store.healthy():
        raise ApiError(
            503, "not_ready", "etcd does not answer (no quorum or unreachable); check the etcd members"
        )
    leader = ctx.extra.get("leader")
    return {"ready": True, "leader": bool(leader() if callable(leader) else False)}


@router.get("/metrics", response_class=Response)
def metrics(ctx: ContextDep) -> Response:
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
