"""The service's Prometheus metrics, all of them, on one registry per app (so several apps can
live in one process, as tests do). Names follow ``elastrain_<subsystem>_<what>_<unit>``.

Per-job series are labelled ``job_id``, as the workers' are (Prometheus owns ``job``: a scraped
``job`` label becomes ``exported_job`` unless the scrape honours labels). A finished job's
series are removed.

The API, the reconciler, the checkpoint coordinator and the state store record into one
:class:`Metrics`; :class:`InstrumentedStore` counts and times every etcd round trip of the store
it wraps. The arithmetic behind recovery phases and goodput is :mod:`service.jobs.recovery`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from service.etcd.kv import Entry, Fence, KVStore, Versioned, Write
from service.jobs.events import merge_progress
from service.jobs.model import JobRecord, JobState, Progress, Recovery
from service.jobs.recovery import estimated_goodput, phases_of

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
JOB = ["job_id"]


class Metrics:
    """Every series the service exports, and what updates them."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # the API
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
        self.worker_throttled = Counter(
            "elastrain_api_worker_throttled_total",
            "Worker callbacks refused (429) because the job's workers were over a budget (requests, "
            "bytes, open checkpoint rounds)",
            ["job_id", "budget"],
            registry=r,
        )
        self.kv_refused = Counter(
            "elastrain_kv_gateway_refused_total",
            "Jobs' etcd requests the key-value gateway refused, by reason (forbidden: outside the "
            "job's keys or leases; over_budget; not_found: an operation jobs may not use; invalid)",
            ["code"],
            registry=r,
        )
        self.forwarded = Counter(
            "elastrain_api_forwarded_total",
            "Writes a standby passed to the leader, by outcome (forwarded, unreachable)",
            ["outcome"],
            registry=r,
        )
        self.connections_cut = Counter(
            "elastrain_api_connections_cut_total",
            "Client connections the service closed: a request's headers or body not sent in time "
            "(header_timeout, body_timeout), or one connection too many (over_limit)",
            ["reason"],
            registry=r,
        )
        # the reconciler and the scheduler it drives
        self.is_leader = Gauge("elastrain_reconciler_is_leader", "1 while this instance leads", registry=r)
        self.passes = Counter("elastrain_reconciler_passes_total", "Reconciler passes", registry=r)
        self.heartbeat_period = Gauge(
            "elastrain_worker_heartbeat_period_seconds",
            "How often each rank is asked to send its heartbeat (longer as the ranks grow)",
            registry=r,
        )
        self.progress_period = Gauge(
            "elastrain_worker_progress_period_seconds",
            "How often each job's rank 0 is asked to send its progress",
            registry=r,
        )
        self.last_pass = Gauge(
            "elastrain_reconciler_last_pass_timestamp_seconds",
            "When the reconciler last completed a pass (Unix time)",
            registry=r,
        )
        self.pass_errors = Counter(
            "elastrain_reconciler_errors_total", "Reconciler errors by kind", ["kind"], registry=r
        )
        self.job_errors = Counter(
            "elastrain_reconciler_job_errors_total",
            "Reconciler failures on one job: its record cannot be read (kind unreadable), or "
            "reconciling it raised (kind processing); the job is failed, the others go on",
            ["job_id", "kind"],
            registry=r,
        )
        self.pass_seconds = Histogram(
            "elastrain_reconciler_pass_duration_seconds",
            "One reconciler pass",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.pass_cpu = Counter(
            "elastrain_reconciler_pass_cpu_seconds_total",
            "CPU time the reconciler's full passes took on their thread (their duration also holds "
            "the time they waited for the interpreter while requests were served)",
            registry=r,
        )
        self.launches = Counter("elastrain_scheduler_launches_total", "Node launches", registry=r)
        self.cancels = Counter("elastrain_scheduler_cancels_total", "Node cancels", registry=r)
        self._jobs(r)
        # checkpoints
        self.published = Counter(
            "elastrain_checkpoints_published_total", "Checkpoints published by the service", registry=r
        )
        self.aborted = Counter("elastrain_checkpoints_aborted_total", "Checkpoint steps aborted", registry=r)
        self.no_space = Counter(
            "elastrain_checkpoints_no_space_aborts_total",
            "Checkpoint steps aborted because a volume (or a quota) was full",
            JOB,
            registry=r,
        )
        self.publish = Histogram(
            "elastrain_checkpoint_publish_duration_seconds",
            "Phase 2 of a checkpoint publish: manifest written and staging renamed into place",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        # the state store
        self.fenced_refusals = Counter(
            "elastrain_fenced_writes_refused_total",
            "Writes etcd refused because this instance's leader fence no longer held (a stale leader)",
            registry=r,
        )
        self.write_behind_dropped = Counter(
            "elastrain_write_behind_dropped_total",
            "Heartbeats and progress reports held for a batched write that etcd refused or could "
            "not take (the next beat or report supersedes them)",
            registry=r,
        )
        self.etcd_requests = Counter(
            "elastrain_etcd_requests_total", "Round trips to the state store", ["op", "outcome"], registry=r
        )
        self.etcd_seconds = Histogram(
            "elastrain_etcd_request_duration_seconds",
            "Latency of one state store round trip",
            ["op"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )

    def _jobs(self, r: CollectorRegistry) -> None:
        self.jobs = Gauge("elastrain_jobs", "Jobs by state", ["state"], registry=r)
        self.step = Gauge("elastrain_job_step", "Newest reported step", JOB, registry=r)
        self.throughput = Gauge(
            "elastrain_job_samples_per_second", "Newest reported throughput", JOB, registry=r
        )
        self.world_size = Gauge("elastrain_job_world_size", "Worker group size", JOB, registry=r)
        self.restarts = Gauge(
            "elastrain_job_restarts",
            "Recoveries that restarted the workers so far (they use max_restarts; peer ones do not)",
            JOB,
            registry=r,
        )
        self.nodes = Gauge("elastrain_job_nodes", "Active nodes (torchrun agents) of a job", JOB, registry=r)
        self.goodput = Gauge(
            "elastrain_job_goodput_ratio", "Productive step time over wall time (estimate)", JOB, registry=r
        )
        self.recovery = Histogram(
            "elastrain_job_recovery_seconds",
            "One incident: the last sign of life of what was lost to the first step of the repaired "
            "group, by kind (peer: state from a peer's memory; storage: from the checkpoint in "
            "process; restart: the workers restarted)",
            ["kind"],
            buckets=_RECOVERY_BUCKETS,
            registry=r,
        )
        self.recovery_phase = Histogram(
            "elastrain_job_recovery_phase_seconds",
            "One phase of a recovery by kind: detect, reform, transfer (peer) or restore, first_step "
            "(merged when a stamp is missing)",
            ["phase", "kind"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.recovery_bytes = Counter(
            "elastrain_job_recovery_bytes_total",
            "Bytes of state a recovery moved, by source (peers: from a survivor's memory; storage: "
            "read from the checkpoint)",
            ["job_id", "source"],
            registry=r,
        )
        self.voided_windows = Counter(
            "elastrain_job_voided_windows_total",
            "Training windows a recovery dropped (in flight when a rank was lost; never applied)",
            JOB,
            registry=r,
        )
        self.rollback_steps = Counter(
            "elastrain_job_rollback_steps_total",
            "Steps redone because a recovery resumed from an older checkpoint",
            JOB,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ------------------------------------------------------------------ jobs

    def observe_jobs(self, records: Sequence[JobRecord]) -> None:
        counts = dict.fromkeys(JobState, 0)
        for record in records:
            counts[record.state] += 1
        for state, count in counts.items():
            self.jobs.labels(state.value).set(count)

    def observe_job(
        self, record: JobRecord, progress: Progress | None, *, now: float, step_seconds: float | None = None
    ) -> None:
        """Per-job gauges from the record and the newest progress; a finished job's are removed.
        The world size is the newest progress's, merged as the reconciler merges it (the API's
        job view shows the same)."""
        record = merge_progress(record, progress)
        per_job = (self.step, self.throughput, self.world_size, self.restarts, self.nodes, self.goodput)
        if record.state.terminal:
            for gauge in per_job:
                with contextlib.suppress(KeyError):
                    gauge.remove(record.id)
            return
        self.restarts.labels(record.id).set(record.restarts)
        self.nodes.labels(record.id).set(len(record.active_nodes))
        if record.world_size:
            self.world_size.labels(record.id).set(record.world_size)
        if progress is not None:
            self.step.labels(record.id).set(progress.step)
            if progress.samples_per_s is not None:
                self.throughput.labels(record.id).set(progress.samples_per_s)
        done = [r.seconds for r in record.recoveries if r.seconds is not None]
        ratio = estimated_goodput(
            wall_seconds=now - record.created_at,
            recovery_seconds=done,
            steps_lost=sum(r.steps_lost or 0 for r in record.recoveries),
            step_seconds=step_seconds,
        )
        if ratio is not None:
            self.goodput.labels(record.id).set(ratio)

    def observe_recovery(self, job_id: str, recovery: Recovery) -> None:
        """Call once when a recovery completes (its first step done): its time and each phase by
        kind, the bytes it moved, the windows it voided and the steps it redid."""
        if recovery.seconds is not None:
            self.recovery.labels(recovery.kind).observe(recovery.seconds)
        for phase in phases_of(recovery):
            self.recovery_phase.labels(phase.name, recovery.kind).observe(phase.seconds)
        # the per-job series exist from the first recovery on (a dashboard shows 0, not nothing)
        self.recovery_bytes.labels(job_id, "peers").inc(recovery.bytes_from_peers)
        self.recovery_bytes.labels(job_id, "storage").inc(recovery.bytes_from_storage)
        self.voided_windows.labels(job_id).inc(recovery.voided_windows)
        self.rollback_steps.labels(job_id).inc(recovery.steps_lost or 0)

    # ------------------------------------------------------------------ etcd

    @contextlib.contextmanager
    def etcd_call(self, op: str) -> Iterator[None]:
        start = time.perf_counter()
        outcome = "error"
        try:
            yield
            outcome = "ok"
        finally:
            self.etcd_requests.labels(op, outcome).inc()
            self.etcd_seconds.labels(op).observe(time.perf_counter() - start)


class InstrumentedStore:
    """A :class:`~service.etcd.kv.KVStore` that counts and times every call of the store it wraps,
    with the same semantics and errors: ``InstrumentedStore(EtcdStore(endpoints), metrics)``."""

    def __init__(self, inner: KVStore, metrics: Metrics) -> None:
        self.inner = inner
        self._metrics = metrics

    def get(self, key: str) -> Versioned | None:
        with self._metrics.etcd_call("get"):
            return self.inner.get(key)

    def list_prefix(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 0,
        keys_only: bool = False,
        last: str | None = None,
    ) -> list[Entry]:
        with self._metrics.etcd_call("list_prefix"):
            return self.inner.list_prefix(
                prefix, start_after=start_after, limit=limit, keys_only=keys_only, last=last
            )

    def commit(self, writes: Sequence[Write], *, fence: Fence | None = None) -> bool:
        with self._metrics.etcd_call("commit"):
            return self.inner.commit(writes, fence=fence)

    def put(self, key: str, value: bytes, *, lease_id: int = 0) -> None:
        with self._metrics.etcd_call("put"):
            self.inner.put(key, value, lease_id=lease_id)

    def lease_grant(self, ttl_s: int) -> int:
        with self._metrics.etcd_call("lease_grant"):
            return self.inner.lease_grant(ttl_s)

    def lease_refresh(self, lease_id: int) -> bool:
        with self._metrics.etcd_call("lease_refresh"):
            return self.inner.lease_refresh(lease_id)

    def lease_revoke(self, lease_id: int) -> None:
        with self._metrics.etcd_call("lease_revoke"):
            self.inner.lease_revoke(lease_id)

    def healthy(self) -> bool:
        with self._metrics.etcd_call("healthy"):
            return self.inner.healthy()
