"""The FastAPI app: ``create_app(settings, store, ...)`` wires routes, auth, errors and limits."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.api import errors
from service.api.deps import Context
from service.api.door import Door
from service.api.forward import ForwardToLeader, LeaderLookup, WorkersListener
from service.api.limits import BodyLimit
from service.api.request_metrics import RequestMetrics
from service.api.routes import gateway, health, workers
from service.api.routes import jobs as job_routes
from service.api.schemas import CheckpointReportRequest
from service.checkpoints.service import Checkpoints
from service.etcd.gateway import KvGateway
from service.etcd.kv import KVStore
from service.jobs.parts import JobParts
from service.jobs.service import ensure_worker_secret
from service.jobs.tokens import hash_token
from service.launch.protocol import Scheduler
from service.metrics import Metrics
from service.settings import Settings
from worker.jobspec.spec import JobSpec

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


def create_app(
    settings: Settings,
    store: KVStore,
    *,
    api_token: str,
    parts: JobParts | None = None,
    scheduler: Scheduler | None = None,
    checkpoints: Checkpoints | None = None,
    metrics: Metrics | None = None,
    secret: bytes | None = None,
    clock: Callable[[], float] = time.time,
    leader: Callable[[], bool] | None = None,
    stalled: Callable[[], str | None] | None = None,
    forward: LeaderLookup | None = None,
    forward_workers: LeaderLookup | None = None,
    holder: str = "",
    lifespan: Lifespan | None = None,
    kv: KvGateway | None = None,
) -> FastAPI:
    """Build the app. ``store`` must be reachable (the worker-token secret is read from it)
    unless ``parts`` (the job duties, built on the same store) are given. With ``forward`` (and
    ``leader``) a standby passes writes to the leader's published address
    (:mod:`service.api.forward`), and with ``forward_workers`` those that came in on its workers'
    port to the leader's workers' listener. ``stalled`` says why the leader is not ready (see
    :meth:`service.reconciler.Reconciler.stalled`)."""
    metrics = metrics or Metrics()
    if parts is None:
        secret = secret or ensure_worker_secret(store)
        parts = JobParts.build(store, storage_root=settings.checkpoint_root, secret=secret, clock=clock)
    app = FastAPI(
        title="elastrain",
        version="0.1.0",
        description="Fault-tolerant elastic training: jobs, scaling, checkpoints.",
        lifespan=lifespan,
        # BodyLimit refuses these on any route, before routing: over the size limit, nested too deep.
        responses=errors.error_responses(413, 422),
    )
    app.state.ctx = Context(
        settings=settings,
        jobs=parts.records,
        progress=parts.progress,
        heartbeats=parts.heartbeats,
        views=parts.views,
        budget=parts.budget,
        metrics=metrics,
        api_token_hash=hash_token(api_token),
        leader=leader or (lambda: False),
        stalled=stalled or (lambda: None),
        scheduler=scheduler,
        checkpoints=checkpoints,
        kv=kv,
    )
    errors.install(app, on_error=lambda code: metrics.errors.labels(code).inc())
    app.include_router(job_routes.router)
    app.include_router(workers.router)
    app.include_router(gateway.router)
    app.include_router(health.router)
    app.add_middleware(workers.InHandCallbacks)  # innermost: a leader's own callbacks in hand
    if forward is not None and leader is not None:
        app.add_middleware(
            ForwardToLeader,
            leading=leader,
            lookup=forward,
            own_url=settings.instance_address,
            holder=holder,
            on_forward=lambda outcome: metrics.forwarded.labels(outcome).inc(),
            forget=parts.records.forget,
            workers=_workers_listener(settings, forward_workers),
        )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)  # outside: bounds what is forwarded
    app.add_middleware(
        Door,  # outside the body's limit: a request without a token is refused before it is read
        public=_public_paths(app),
        api_token_hash=app.state.ctx.api_token_hash,
        secret=parts.records.secret,
        on_refused=lambda code: metrics.errors.labels(code).inc(),
    )
    app.add_middleware(RequestMetrics, metrics=metrics)
    _document_spec(app)
    return app


def _workers_listener(settings: Settings, lookup: LeaderLookup | None) -> WorkersListener | None:
    """This instance's workers' listener, for forwarding; None without a worker port."""
    own = settings.instance_workers_address
    if settings.worker_port is None or lookup is None or own is None:
        return None
    return WorkersListener(port=settings.worker_port, lookup=lookup, own_url=own)


def _public_paths(app: FastAPI) -> frozenset[str]:
    """What anyone may call without a token: the probes and metrics (the health routes) and the
    API's own description (the OpenAPI schema and its viewers)."""
    docs = (app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url)
    return frozenset([route.path for route in health.router.routes] + [d for d in docs if d])  # type: ignore[attr-defined]


def _document_spec(app: FastAPI) -> None:
    """Put the bodies that routes validate themselves (see ``schemas.body_of``) into the OpenAPI
    components: the JobSpec (POST /v1/jobs) and a rank's checkpoint report."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (JobSpec, CheckpointReportRequest):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
        bearer = {"type": "http", "scheme": "bearer"}
        schema["components"].setdefault("securitySchemes", {})["bearer"] = bearer
        schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
