"""The jobs' key-value gateway route, ``POST /v1/jobs/{job_id}/kv/{op}``: a job's etcd requests
(the bodies of etcd's v3 JSON gateway), authenticated by the job's worker token and checked by
:mod:`service.etcd.gateway_rules` before the service's own etcd client sends them."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from service.api.deps import Context, ContextDep, WorkerAuth
from service.api.errors import ApiError, error_responses
from service.api.routes.workers import _job, _write
from service.etcd.gateway_rules import WRITES, GatewayRefused
from worker.etcdclient import EtcdRefusedError

router = APIRouter(prefix="/v1/jobs/{job_id}", tags=["workers"])


@router.post(
    "/kv/{op:path}",
    responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    openapi_extra={
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"type": "object"}}}}
    },
)
async def kv(job_id: str, op: str, auth: WorkerAuth, ctx: ContextDep, request: Request) -> dict[str, Any]:
    """One etcd v3 request of the job's rendezvous or peer group (``kv/range``, ``kv/put``,
    ``kv/txn``, ``kv/deleterange``, ``lease/grant``, ``lease/keepalive``, ``kv/lease/revoke``),
    confined to the job's keys, leases and budget; the answer is etcd's."""
    body = _parse(await request.body())
    return await run_in_threadpool(_forward, ctx, job_id, op, body, auth, request)


def _forward(
    ctx: Context, job_id: str, op: str, body: dict[str, Any], auth: str, request: Request
) -> dict[str, Any]:
    if ctx.kv is None:
        raise ApiError(501, "not_supported", "this service runs without a key-value gateway")
    record = _job(ctx, job_id, auth, request, recent=True)
    if op in WRITES:
        _write(ctx, auth, record, len(json.dumps(body)))
    try:
        return ctx.kv.handle(job_id, op, body)
    except GatewayRefused as exc:
        ctx.metrics.kv_refused.labels(exc.code).inc()
        raise ApiError(exc.status, exc.code, exc.message) from None
    except EtcdRefusedError as exc:  # etcd's own answer (a lease that expired): the job's to handle
        raise ApiError(409, "etcd_refused", f"etcd refused {op}: {_etcd_message(exc.detail)}") from None


def _parse(raw: bytes) -> dict[str, Any]:
    """The body as one JSON object; a key given twice is refused (etcd's decoder and ours could
    keep different ones)."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            raise ApiError(422, "invalid", "a JSON object names the same field twice")
        return dict(items)

    try:
        body = json.loads(raw or b"{}", object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        raise ApiError(400, "malformed_json", "the request body is not valid JSON; fix its syntax") from None
    if not isinstance(body, dict):
        raise ApiError(422, "invalid", "the request body must be a JSON object")
    return body


def _etcd_message(detail: str) -> str:
    try:
        parsed = json.loads(detail)
    except ValueError:
        return detail
    return str(parsed.get("message") or parsed.get("error") or detail) if isinstance(parsed, dict) else detail
