"""What routes depend on: the service context and the two kinds of authentication."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from service.api.auth import Principal, authorize, bearer
from service.api.errors import ApiError
from service.checkpoints.service import Checkpoints
from service.etcd.gateway import KvGateway
from service.jobs.budget import WorkerBudget
from service.jobs.cache import TTLCache
from service.jobs.heartbeats import Heartbeats
from service.jobs.progress import ProgressBuffer
from service.jobs.service import JobService
from service.launch.protocol import Scheduler
from service.metrics import Metrics
from service.settings import Settings


@dataclass(frozen=True, kw_only=True, slots=True)
class Context:
    """Everything a request may use; one per app, on ``app.state.ctx``."""

    settings: Settings
    jobs: JobService
    progress: ProgressBuffer
    heartbeats: Heartbeats
    views: TTLCache[bytes]
    """Rendered GET /v1/jobs/{id} bodies; dropped on every write this instance makes."""
    budget: WorkerBudget
    """What each job's workers may still send."""
    metrics: Metrics
    api_token_hash: str
    leader: Callable[[], bool]
    """Whether this instance leads (runs the reconciler)."""
    stalled: Callable[[], str | None] = lambda: None
    """Why this instance, as the leader, is not ready (its reconciler's passes stopped
    completing); None when it is."""
    scheduler: Scheduler | None = None
    """None: the app runs without a scheduler (tests of the API alone); logs are then unreadable."""
    checkpoints: Checkpoints | None = None
    """None: the app runs without checkpoint duties (tests of the API alone)."""
    kv: KvGateway | None = None
    """The jobs' key-value gateway (None: the app runs without one)."""


# Dependencies are ``async def`` on purpose: they do no I/O, and FastAPI would run plain
# ``def`` dependencies in the thread pool (a thread hop per request on the hot GET path).
async def get_context(request: Request) -> Context:
    ctx: Context = request.app.state.ctx
    return ctx


ContextDep = Annotated[Context, Depends(get_context)]


def _check(request: Request, ctx: Context, *, job_id: str | None, worker_route: bool) -> Principal:
    decision = authorize(
        bearer(request.headers.get("authorization")),
        api_token_hash=ctx.api_token_hash,
        secret=ctx.jobs.secret,
        job_id=job_id,
        worker_route=worker_route,
    )
    if decision.principal is None:
        raise ApiError(decision.status, decision.code, decision.message)
    return decision.principal


async def require_api(request: Request, ctx: ContextDep) -> Principal:
    return _check(request, ctx, job_id=None, worker_route=False)


async def require_worker(job_id: str, request: Request, ctx: ContextDep) -> Principal:
    """The API token, or the worker token of the job in the path."""
    return _check(request, ctx, job_id=job_id, worker_route=True)


ApiAuth = Annotated[Principal, Depends(require_api)]
WorkerAuth = Annotated[Principal, Depends(require_worker)]
