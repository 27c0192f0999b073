"""Worker callbacks under /v1/jobs/{job_id}: the API token or that job's worker token."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.auth import bearer
from service.api.deps import Context, ContextDep, WorkerAuth
from service.api.errors import ApiError, error_response, error_responses, from_domain, from_validation
from service.api.schemas import (
    MAX_COUNT,
    MAX_ROUND,
    MAX_WORLD_SIZE,
    Ack,
    CheckpointReportRequest,
    HeartbeatRequest,
    ParamInt,
    ProgressRequest,
    WorkerEventRequest,
    body_of,
)
from service.checkpoints.results import CheckpointOutcome, ResumeAnswer
from service.checkpoints.service import Checkpoints
from service.jobs.callbacks import check_event, check_node, check_open, check_step, check_world_size
from service.jobs.errors import OverBudgetError
from service.jobs.model import JobRecord, JobState, Progress
from service.jobs.tokens import hash_token
from worker.errors import ElastrainError

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["workers"])
# What each route can answer besides success (413 and a too-deep 422 are app-wide, see app.py).
_READ = error_responses(401, 403, 404, 422, 503)
_WRITE = error_responses(400, 401, 403, 404, 409, 422, 503)


def _job(
    ctx: Context,
    job_id: str,
    principal: str,
    request: Request,
    *,
    recent: bool = False,
    known: JobRecord | None = None,
) -> JobRecord:
    """The job, and the caller may act on it. ``recent``: the record this instance holds will do
    (the frequent heartbeats, progress and checkpoint reports; while it leads, that is the stored
    one: only the leader writes records, and its own writes drop what it held); ``known``: that
    record, already in hand. A worker token stops working when the job ends (409)."""
    record = known if known is not None else ctx.jobs.get_recent(job_id) if recent else ctx.jobs.get(job_id)
    token = bearer(request.headers.get("authorization")) or ""
    if principal == "worker" and hash_token(token) != record.worker_token_hash:
        raise ApiError(403, "forbidden", f"this worker token does not belong to job {job_id!r}")
    if principal == "worker":
        check_open(record)
    return record


def _write(ctx: Context, principal: str, record: JobRecord, size: int) -> None:
    """A callback that writes: the job has not ended, and a worker is within its job's budget
    (:mod:`service.jobs.budget`; the operator's API token is not budgeted)."""
    check_open(record)
    if principal != "worker":
        return
    world_size = record.world_size or record.desired_nodes * record.nproc_per_node
    try:
        ctx.budget.charge(record.id, world_size=world_size, size=size)
    except OverBudgetError as exc:
        ctx.metrics.worker_throttled.labels(record.id, exc.budget).inc()
        raise


def _size(request: Request) -> int:
    """The body's size as sent (BodyLimit has read and bounded it)."""
    try:
        return int(request.headers.get("content-length", "0"))
    except ValueError:
        return 0


def _checkpoints(ctx: Context) -> Checkpoints:
    if ctx.checkpoints is None:
        raise ApiError(501, "not_supported", "this service runs without a checkpoint coordinator")
    return ctx.checkpoints


def _ack(ctx: Context, record: JobRecord) -> Ack:
    cadence = ctx.heartbeats.cadence
    return Ack(
        state=record.state,
        cancel_requested=record.cancel_requested,
        heartbeat_s=cadence.heartbeat_s,
        progress_s=cadence.progress_s,
    )


def _in_hand(ctx: Context, job_id: str) -> JobRecord | None:
    """The job's record when a heartbeat or progress report needs no I/O, so it is taken on the
    event loop: this instance leads, writes them behind (:mod:`service.jobs.writebehind`), holds
    the record (``_job``'s ``recent``), and the job is not recovering or rescaling (a report may
    end that: a write). Else None: a worker thread takes it. With thousands of ranks a thread per
    callback would take the interpreter lock from the reconciler's thread in turns with dozens."""
    record = ctx.jobs.cached_recent(job_id)
    if record is None or not ctx.leader() or not ctx.heartbeats.deferred:
        return None
    return None if record.state in (JobState.RECOVERING, JobState.RESCALING) else record


async def _take(ctx: Context, job_id: str, handle: Callable[..., Ack], *args: Any) -> Ack:
    """``handle(ctx, job_id, *args, known)`` on the event loop when the job is in hand
    (:func:`_in_hand`), else on a worker thread with ``known`` None."""
    known = _in_hand(ctx, job_id)
    if known is not None:
        return handle(ctx, job_id, *args, known)
    return await run_in_threadpool(handle, ctx, job_id, *args, None)


@router.post("/workers/heartbeat", response_model=Ack, responses=_WRITE)
async def heartbeat(
    job_id: str, body: HeartbeatRequest, auth: WorkerAuth, ctx: ContextDep, request: Request
) -> Ack:
    """A rank is alive. The answer says whether the job is being cancelled."""
    return await _take(ctx, job_id, _heartbeat, body, auth, request)


def _heartbeat(
    ctx: Context, job_id: str, body: HeartbeatRequest, auth: str, request: Request, known: JobRecord | None
) -> Ack:
    record = _job(ctx, job_id, auth, request, recent=True, known=known)
    check_node(record, body.launch_id, body.local_rank)
    _write(ctx, auth, record, _size(request))
    ctx.heartbeats.beat(job_id, body.launch_id, body.local_rank, body.step)
    return _ack(ctx, record)


@router.post("/workers/progress", response_model=Ack, responses=_WRITE)
async def progress(
    job_id: str, body: ProgressRequest, auth: WorkerAuth, ctx: ContextDep, request: Request
) -> Ack:
    """Newest training progress (rank 0): step, samples seen, samples/s, loss, world size."""
    return await _take(ctx, job_id, _progress, body, auth, request)


def _progress(
    ctx: Context, job_id: str, body: ProgressRequest, auth: str, request: Request, known: JobRecord | None
) -> Ack:
    record = _job(ctx, job_id, auth, request, recent=True, known=known)
    check_world_size(record, body.world_size)
    _write(ctx, auth, record, _size(request))
    report = Progress(**body.model_dump(), time=ctx.jobs.clock())
    ctx.progress.report(record, report)
    ctx.metrics.observe_job(record, report, now=report.time)
    ctx.jobs.progress_reported(record, report)  # may end a recovery (the reconciler observes it)
    return _ack(ctx, record)


@router.post("/workers/events", response_model=Ack, responses=_WRITE)
def event(job_id: str, body: WorkerEventRequest, auth: WorkerAuth, ctx: ContextDep, request: Request) -> Ack:
    """group_formed (rank 0, once per formation), state_loaded, first_step, failed, finished, log;
    in peer mode recovery (started, done) and spare_promoted."""
    before = _job(ctx, job_id, auth, request)
    check_event(before, body, now=ctx.jobs.clock())
    _write(ctx, auth, before, _size(request))
    return _ack(ctx, ctx.jobs.worker_event(job_id, body))


@router.post(
    "/workers/checkpoints",
    response_model=CheckpointOutcome,
    responses={**_WRITE, **error_responses(501)},
    openapi_extra={"requestBody": body_of("CheckpointReportRequest")},
)
async def checkpoint_report(
    job_id: str,
    auth: WorkerAuth,
    ctx: ContextDep,
    request: Request,
    seq: Annotated[ParamInt, Query(ge=0, le=MAX_ROUND, description="Save number within the generation")] = 0,
) -> CheckpointOutcome:
    """Phase 1 report of one rank (the JSON of ``worker.checkpoint.commit.report_to_json``).
    The answer says whether the step is pending, published or aborted (the fields of
    ``worker.checkpoint.coordinator.Outcome`` plus ``status``). Idempotent per rank."""
    record = await run_in_threadpool(lambda: _job(ctx, job_id, auth, request, recent=True))
    body = await request.body()
    try:  # the shape only; the coordinator parses and stores the bytes exactly as sent
        shape = CheckpointReportRequest.model_validate_json(body)
    except ValidationError as exc:
        err = from_validation(list(exc.errors(include_url=False)))
        hint = "send a rank's checkpoint report (the JSON of worker.checkpoint.commit.report_to_json)"
        raise ApiError(err.status, err.code, f"{err.message}; {hint}", field=err.field) from None
    checkpoints = _checkpoints(ctx)
    return await run_in_threadpool(
        lambda: _report(ctx, record, checkpoints=checkpoints, auth=auth, shape=shape, body=body, seq=seq)
    )


def _report(
    ctx: Context,
    record: JobRecord,
    *,
    checkpoints: Checkpoints,
    auth: str,
    shape: CheckpointReportRequest,
    body: bytes,
    seq: int,
) -> CheckpointOutcome:
    """A rank's report, checked against the job (world size, step window, budget), then phase 2."""
    check_world_size(record, shape.world_size)
    newest = ctx.progress.newest(record.id, leading=ctx.leader())
    check_step(record, shape.step, newest=newest.step if newest else record.last_step)
    _write(ctx, auth, record, len(body))
    try:
        return checkpoints.publisher.report(record, body, seq=seq)
    except OverBudgetError as exc:  # too many saves open at once
        ctx.metrics.worker_throttled.labels(record.id, exc.budget).inc()
        raise


@router.get(
    "/workers/checkpoints/{step}",
    response_model=CheckpointOutcome,
    responses={**_READ, **error_responses(501)},
)
def checkpoint_outcome(
    job_id: str,
    step: Annotated[ParamInt, Path(ge=0, le=MAX_COUNT)],
    auth: WorkerAuth,
    ctx: ContextDep,
    request: Request,
    generation: Annotated[ParamInt, Query(ge=0, le=MAX_ROUND)] = 0,
    seq: Annotated[ParamInt, Query(ge=0, le=MAX_ROUND)] = 0,
) -> CheckpointOutcome:
    """Whether a reported step was published, is pending or was aborted."""
    record = _job(ctx, job_id, auth, request)
    return _checkpoints(ctx).publisher.outcome(record, step, generation, seq=seq)


@router.get("/resume", response_model=ResumeAnswer, responses=_READ)
def resume(
    job_id: str,
    auth: WorkerAuth,
    ctx: ContextDep,
    request: Request,
    world_size: Annotated[ParamInt | None, Query(ge=1, le=MAX_WORLD_SIZE)] = None,
    rank: Annotated[ParamInt | None, Query(ge=0)] = None,
) -> ResumeAnswer:
    """The newest published, verified checkpoint and the load plan for ``world_size``."""
    record = _job(ctx, job_id, auth, request)
    if ctx.checkpoints is None:
        return ResumeAnswer(job=job_id, checkpoint=None, load_plan=None)
    return ctx.checkpoints.resumes.resume(record, world_size=world_size, rank=rank)


# ------------------------------------------------------------------ callbacks in hand, unrouted

_IN_HAND_PATH = re.compile(r"/v1/jobs/([^/]+)/workers/(heartbeat|progress)")


def _in_hand_routes() -> dict[str, tuple[type[BaseModel], Callable[..., Ack], BaseRoute]]:
    """Per callback taken in hand: its body's model, its handler and its route (for metrics)."""
    handlers: dict[str, tuple[type[BaseModel], Callable[..., Ack]]] = {
        "heartbeat": (HeartbeatRequest, _heartbeat),
        "progress": (ProgressRequest, _progress),
    }
    routes = {getattr(r, "path", "").rsplit("/", 1)[-1]: r for r in router.routes}
    return {kind: (model, handle, routes[kind]) for kind, (model, handle) in handlers.items()}


_IN_HAND = _in_hand_routes()


class InHandCallbacks:
    """ASGI middleware, inside the door, the body limit and leader forwarding: a heartbeat or
    progress report from the job's own worker token, for a job in hand (:func:`_in_hand`), with
    a body its route takes, is handled here by the route's own handler, without FastAPI's
    routing and dependency resolution, which cost the event loop more than the handler itself
    (and there thousands of ranks' callbacks queue ahead of the users' reads). The answer, its
    errors and its metrics are the route's. Everything else goes on to the routes unchanged (so
    every refusal before the handler runs, and every other caller, is answered by the routes)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = None
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("query_string"):
            found = _IN_HAND_PATH.fullmatch(scope["path"])
        if found is None:
            await self.app(scope, receive, send)
            return
        messages = [await receive()]
        while messages[-1]["type"] == "http.request" and messages[-1].get("more_body"):
            messages.append(await receive())

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if messages[-1]["type"] == "http.request":
            answer = _answer_in_hand(scope, replay, found.group(1), found.group(2), body)
            if answer is not None:
                await answer(scope, replay, send)
                return
        await self.app(scope, replay, send)


def _answer_in_hand(scope: Scope, receive: Receive, job_id: str, kind: str, body: bytes) -> Response | None:
    """The route's answer to a callback in hand, or None when the routes must take it."""
    ctx: Context = scope["app"].state.ctx
    headers = Headers(scope=scope)
    record = _in_hand(ctx, job_id)
    token = bearer(headers.get("authorization"))
    if record is None or token is None or hash_token(token) != record.worker_token_hash:
        return None
    if headers.get("content-type") != "application/json":
        return None
    model, handle, route = _IN_HAND[kind]
    try:
        parsed = model.model_validate(json.loads(body))
    except ValueError:  # not JSON, or not this route's body (ValidationError): the route says why
        return None
    scope["route"] = route  # the request's metrics are labelled with its route, as routed

    def count(code: str) -> None:
        ctx.metrics.errors.labels(code).inc()

    try:
        ack = handle(ctx, job_id, parsed, "worker", Request(scope, receive), record)
    except ApiError as exc:
        return error_response(exc, count)
    except ElastrainError as exc:
        return error_response(from_domain(exc), count)
    return Response(ack.model_dump_json().encode(), media_type="application/json")
