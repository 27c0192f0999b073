"""The service's Prometheus metrics, on a registry per app (so several apps can live in one
process, as tests do). Names follow ``elastrain_<subsystem>_<what>_<unit>``."""

from __future__ import annotations

import contextlib
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.jobs.model import JobRecord, JobState, Progress

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_RECOVERY_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300, 600)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "elastrain_api_requests_total", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "elastrain_api_request_duration_seconds",
            "HTTP request latency",
            ["method", "route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter("elastrain_api_errors_total", "Error responses by code", ["code"], registry=r)
        self.forwarded = Counter(
            "elastrain_api_forwarded_total",
            "Writes a standby passed to the leader, by outcome (forwarded, unreachable)",
            ["outcome"],
            registry=r,
        )
        self.jobs = Gauge("elastrain_jobs", "Jobs by state", ["state"], registry=r)
        self.is_leader = Gauge("elastrain_reconciler_is_leader", "1 while this instance leads", registry=r)
        self.passes = Counter("elastrain_reconciler_passes_total", "Reconciler passes", registry=r)
        self.pass_errors = Counter(
            "elastrain_reconciler_errors_total", "Reconciler errors by kind", ["kind"], registry=r
        )
        self.pass_seconds = Histogram(
            "elastrain_reconciler_pass_duration_seconds",
            "One reconciler pass",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.launches = Counter("elastrain_scheduler_launches_total", "Node launches", registry=r)
        self.cancels = Counter("elastrain_scheduler_cancels_total", "Node cancels", registry=r)
        self.step = Gauge("elastrain_job_step", "Newest reported step", ["job"], registry=r)
        self.throughput = Gauge(
            "elastrain_job_samples_per_second", "Newest reported throughput", ["job"], registry=r
        )
        self.world_size = Gauge("elastrain_job_world_size", "Worker group size", ["job"], registry=r)
        self.restarts = Gauge("elastrain_job_restarts", "Restarts so far (recoveries)", ["job"], registry=r)
        self.recovery = Histogram(
            "elastrain_job_recovery_seconds",
            "Failure to first step after resume",
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.published = Counter(
            "elastrain_checkpoints_published_total", "Checkpoints published by the service", registry=r
        )
        self.aborted = Counter("elastrain_checkpoints_aborted_total", "Checkpoint steps aborted", registry=r)
        from service.observability import ServiceObservability

        self.obs = ServiceObservability(r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_jobs(self, records: list[JobRecord]) -> None:
        counts = dict.fromkeys(JobState, 0)
        for record in records:
            counts[record.state] += 1
        for state, count in counts.items():
            self.jobs.labels(state.value).set(count)

    def observe_job(self, record: JobRecord, progress: Progress | None) -> None:
        self.obs.observe_job(record, now=time.time())
        if record.state.terminal:
            for gauge in (self.step, self.throughput, self.world_size, self.restarts):
                with contextlib.suppress(KeyError):
                    gauge.remove(record.id)
            return
        self.restarts.labels(record.id).set(record.restarts)
        if record.world_size:
            self.world_size.labels(record.id).set(record.world_size)
        if progress is not None:
            self.step.labels(record.id).set(progress.step)
            if progress.samples_per_s is not None:
                self.throughput.labels(record.id).set(progress.samples_per_s)


class RequestMetrics:
    """ASGI middleware: count and time every request by its route template."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = [500]

        async def record_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            method = str(scope.get("method", ""))
            self.metrics.requests.labels(method, route, str(status[0])).inc()
            self.metrics.latency.labels(method, route).observe(time.perf_counter() - start)
