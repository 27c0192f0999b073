"""User-facing job routes under /v1 (API token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from service.api.admission import admit
from service.api.deps import Context, ContextDep, require_api
from service.api.errors import error_responses
from service.api.logfiles import tail_lines
from service.api.schemas import (
    CheckpointList,
    JobList,
    JobLogs,
    JobPublic,
    ParamInt,
    ScaleRequest,
    body_of,
    public,
    spec_from_body,
    summary,
)
from service.jobs.events import merge_progress
from service.jobs.model import JobState

router = APIRouter(prefix="/v1", tags=["jobs"], dependencies=[Depends(require_api)])
# What each route can answer besides success (413 and a too-deep 422 are app-wide, see app.py).
_V1 = (401, 403, 503)  # the token is refused; etcd is unreachable or this instance is not the leader
_JOB = (*_V1, 404)


@router.post(
    "/jobs",
    status_code=201,
    response_model=JobPublic,
    responses={
        200: {"description": "Same Idempotency-Key: the existing job", "model": JobPublic},
        **error_responses(400, *_V1, 409, 422),
    },
    openapi_extra={"requestBody": body_of("JobSpec")},
)
async def submit_job(
    request: Request,
    ctx: ContextDep,
    idempotency_key: Annotated[
        str | None, Header(alias="Idempotency-Key", min_length=1, max_length=255)
    ] = None,
) -> JSONResponse:
    """Submit a JobSpec. With ``Idempotency-Key`` the same key returns the same job (200)."""
    spec = spec_from_body(await request.body())
    notes = admit(spec, ctx.settings)
    record, created = await run_in_threadpool(
        ctx.jobs.create, spec, idempotency_key=idempotency_key, notes=notes
    )
    view = public(record, None).model_dump(mode="json")
    headers = {"Location": f"/v1/jobs/{record.id}"}
    return JSONResponse(view, status_code=201 if created else 200, headers=headers)


@router.get("/jobs", response_model=JobList, responses=error_responses(*_V1, 422))
def list_jobs(
    ctx: ContextDep,
    state: Annotated[JobState | None, Query(description="Only jobs in this state")] = None,
    limit: Annotated[ParamInt, Query(ge=1, le=500)] = 50,
    cursor: Annotated[
        str | None, Query(max_length=100, description="next_cursor of the previous page")
    ] = None,
) -> JobList:
    records, next_cursor = ctx.jobs.list(state=state, limit=limit, cursor=cursor)
    # A live job's world size as GET /v1/jobs/{id} shows it: its newest progress merged in (one
    # read for the page). A finished job is listed as stored: the reconciler wrote its final
    # state with the progress it held merged in
    progress = ctx.progress.newest_of([r.id for r in records if not r.state.terminal])
    merged = [r if r.state.terminal else merge_progress(r, progress[r.id]) for r in records]
    return JobList(jobs=[summary(r) for r in merged], next_cursor=next_cursor)


@router.get("/jobs/{job_id}", response_model=JobPublic, responses=error_responses(*_JOB))
async def get_job(job_id: str, ctx: ContextDep) -> Response:
    """State, world size, nodes, restarts, last published step, progress, recent events.
    Served from a short-lived cache that this instance's own writes invalidate."""
    body = ctx.views.get(job_id) or _render_in_hand(ctx, job_id)
    if body is None:
        body = await run_in_threadpool(_render, ctx, job_id)
    return Response(body, media_type="application/json")


def _render_in_hand(ctx: Context, job_id: str) -> bytes | None:
    """The job's view rendered on the event loop when it needs no etcd read: this instance
    leads, holds the record (the workers' callbacks keep it) and the progress reported in this
    term. Else None (a worker thread reads etcd): a thread would wait for the interpreter
    behind the reconciler's and the callbacks' threads."""
    if not ctx.leader():
        return None
    stamp = ctx.views.stamp()
    record = ctx.jobs.cached_recent(job_id)
    progress = ctx.progress.in_hand(job_id) if record is not None else None
    if record is None or progress is None:
        return None
    body = public(record, progress).model_dump_json().encode()
    ctx.views.put(job_id, body, stamp=stamp)
    return body


def _render(ctx: Context, job_id: str) -> bytes:
    stamp = ctx.views.stamp()
    body = public(ctx.jobs.get(job_id), ctx.progress.newest(job_id)).model_dump_json().encode()
    ctx.views.put(job_id, body, stamp=stamp)
    return body


@router.post(
    "/jobs/{job_id}/scale",
    status_code=202,
    response_model=JobPublic,
    responses=error_responses(400, *_JOB, 409, 422),
)
def scale_job(job_id: str, body: ScaleRequest, ctx: ContextDep) -> JobPublic:
    """Set the desired node count within the job's ``nodes`` range; the reconciler acts on it."""
    return public(ctx.jobs.scale(job_id, body.nodes), ctx.progress.newest(job_id))


@router.delete(
    "/jobs/{job_id}", status_code=202, response_model=JobPublic, responses=error_responses(*_JOB, 409)
)
def cancel_job(job_id: str, ctx: ContextDep) -> JobPublic:
    """Cancel a job. Idempotent: cancelling a finished or cancelling job returns it unchanged."""
    return public(ctx.jobs.cancel(job_id), ctx.progress.newest(job_id))


@router.get("/jobs/{job_id}/checkpoints", response_model=CheckpointList, responses=error_responses(*_JOB))
def list_checkpoints(job_id: str, ctx: ContextDep) -> CheckpointList:
    """Published checkpoints, oldest first: step, world size, bytes, time, verified, directory."""
    record = ctx.jobs.get(job_id)
    if ctx.checkpoints is None:
        return CheckpointList(job=job_id, checkpoints=[])
    return CheckpointList(job=job_id, checkpoints=ctx.checkpoints.registry.published(record))


@router.get("/jobs/{job_id}/logs", response_model=JobLogs, responses=error_responses(*_JOB, 422))
def job_logs(
    job_id: str,
    ctx: ContextDep,
    node: Annotated[ParamInt | None, Query(ge=0)] = None,
    tail: Annotated[ParamInt, Query(ge=1, le=10_000)] = 200,
) -> JobLogs:
    """The last ``tail`` lines of each node's logs (or of ``node``), as the scheduler keeps them.
    A node whose logs the service cannot read (kubernetes keeps them in the cluster) is named
    in ``note`` instead."""
    record = ctx.jobs.get(job_id)
    out: dict[str, list[str]] = {}
    unreadable: list[str] = []
    for n in record.nodes:
        if n.handle and (node is None or n.index == node):
            directory = ctx.scheduler.log_dir(n.handle) if ctx.scheduler is not None else None
            if directory is None:
                unreadable.append(n.launch_id)
            else:
                out[n.launch_id] = tail_lines(directory, tail)
    note = None
    if unreadable:
        note = (
            f"the scheduler keeps no logs the service can read for {', '.join(unreadable)}; "
            "read them where the nodes run (for kubernetes: kubectl logs)"
        )
    return JobLogs(job=job_id, nodes=out, note=note)
