"""Service metrics the control plane still lacks beyond :mod:`service.api.metrics`, and the pure
arithmetic behind them (recovery phases, goodput), shared with ``elastrain report``.

:class:`ServiceObservability` registers on the registry of :class:`service.api.metrics.Metrics`
(``ServiceObservability(metrics.registry)``) and defines only what is not there yet:

* ``elastrain_job_recovery_phase_seconds{phase}``: each phase of a recovery (``detect``,
  ``reform``, ``restore``, ``first_step``; a missing time stamp merges two, e.g.
  ``detect+reform``);
* ``elastrain_job_rollback_steps_total{job_id}``: steps redone because a recovery resumed from
  a checkpoint older than the last step reached;
* ``elastrain_job_nodes{job_id}`` and ``elastrain_job_goodput_ratio{job_id}``;
* ``elastrain_checkpoint_publish_duration_seconds``: phase 2 of a publish (manifest, rename);
* ``elastrain_etcd_requests_total{op,outcome}`` and ``elastrain_etcd_request_duration_seconds{op}``
  through :class:`InstrumentedStore`, a drop-in wrapper of any ``KVStore``.

Per-job labels are ``job_id`` (Prometheus owns ``job``: a scraped ``job`` label becomes
``exported_job`` unless the scrape honours labels).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PHASES = ("detect", "reform", "restore", "first_step")
_PHASE_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    start: float
    seconds: float


def recovery_phases(
    *,
    failed_at: float,
    detected_at: float | None = None,
    group_formed_at: float | None = None,
    state_loaded_at: float | None = None,
    first_step_at: float | None = None,
    from_detection: bool = False,
) -> list[Phase]:
    """The phases of one recovery, in order, from the time stamps known. ``failed_at`` is the
    failure (or the last sign of life before it); with ``from_detection`` it is the moment the
    failure was noticed and there is no detect phase. A phase whose end is unknown merges into
    the next one (``detect+reform``); phases after the last known stamp are left out."""
    ends = (detected_at, group_formed_at, state_loaded_at, first_step_at)
    out: list[Phase] = []
    start, merged = failed_at, []
    skip = 1 if from_detection else 0
    for name, end in zip(PHASES[skip:], ends[skip:], strict=True):
        merged.append(name)
        if end is None:
            continue
        out.append(Phase("+".join(merged), start, max(0.0, end - start)))
        start, merged = max(start, end), []
    return out


def goodput(*, wall_seconds: float, productive_seconds: float) -> float | None:
    """Productive step time over wall time, in [0, 1]; None before any wall time passed."""
    if wall_seconds <= 0:
        return None
    return min(1.0, max(0.0, productive_seconds / wall_seconds))


def estimated_goodput(
    *, wall_seconds: float, recovery_seconds: Sequence[float], steps_lost: int, step_seconds: float | None
) -> float | None:
    """The service's view (it sees no step times): wall time less recoveries and redone steps."""
    lost = sum(recovery_seconds) + steps_lost * (step_seconds or 0.0)
    return goodput(wall_seconds=wall_seconds, productive_seconds=wall_seconds - lost)


class ServiceObservability:
    """The missing service metrics, on an existing registry (one per app)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.recovery_phase = Histogram(
            "elastrain_job_recovery_phase_seconds",
            "One phase of a recovery: detect, reform, restore, first_step (merged when a stamp is missing)",
            ["phase"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.rollback_steps = Counter(
            "elastrain_job_rollback_steps_total",
            "Steps redone because a recovery resumed from an older checkpoint",
            ["job_id"],
            registry=r,
        )
        self.nodes = Gauge(
            "elastrain_job_nodes", "Active nodes (torchrun agents) of a job", ["job_id"], registry=r
        )
        self.goodput = Gauge(
            "elastrain_job_goodput_ratio",
            "Productive step time over wall time (estimate)",
            ["job_id"],
            registry=r,
        )
        self.publish = Histogram(
            "elastrain_checkpoint_publish_duration_seconds",
            "Phase 2 of a checkpoint publish: manifest written and staging renamed into place",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.fenced_refusals = Counter(
            "elastrain_fenced_writes_refused_total",
            "Writes etcd refused because this instance's leader fence no longer held (a stale leader)",
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

    def observe_recovery(self, job_id: str, recovery: Any, *, last_seen_at: float | None = None) -> None:
        """Call once when a recovery completes (``service.jobs.model.Recovery``, first step done).
        ``last_seen_at``: newest heartbeat/progress before the failure, if known (the detect
        phase needs it; without it phases start at the service's ``failed_at``)."""
        for phase in recovery_phases(
            failed_at=recovery.failed_at if last_seen_at is None else last_seen_at,
            detected_at=recovery.failed_at,
            group_formed_at=recovery.group_formed_at,
            state_loaded_at=recovery.state_loaded_at,
            first_step_at=recovery.first_step_at,
            from_detection=last_seen_at is None,
        ):
            self.recovery_phase.labels(phase.name).observe(phase.seconds)
        rollback = self.rollback_steps.labels(job_id)  # the series exists from the first recovery on
        if recovery.steps_lost:
            rollback.inc(recovery.steps_lost)

    def observe_job(self, record: Any, *, now: float, step_seconds: float | None = None) -> None:
        """Per-job gauges from a ``JobRecord``; a finished job's series are removed."""
        if record.state.terminal:
            for gauge in (self.nodes, self.goodput):
                with contextlib.suppress(KeyError):
                    gauge.remove(record.id)
            return
        self.nodes.labels(record.id).set(len(record.active_nodes))
        done = [r.seconds for r in record.recoveries if r.seconds is not None]
        lost = sum(r.steps_lost or 0 for r in record.recoveries)
        ratio = estimated_goodput(
            wall_seconds=now - record.created_at,
            recovery_seconds=done,
            steps_lost=lost,
            step_seconds=step_seconds,
        )
        if ratio is not None:
            self.goodput.labels(record.id).set(ratio)

    def observe_publish(self, seconds: float) -> None:
        self.publish.observe(seconds)

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
    """A ``KVStore`` (service.etcd.kv) that counts and times every call of the store it wraps, with
    the same semantics and errors: ``InstrumentedStore(EtcdStore(endpoints), obs)``."""

    def __init__(self, inner: Any, obs: ServiceObservability) -> None:
        self.inner = inner
        self._obs = obs

    def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        with self._obs.etcd_call(op):
            return getattr(self.inner, op)(*args, **kwargs)

    def get(self, key: str) -> Any:
        return self._call("get", key)

    def list_prefix(self, prefix: str, *, start_after: str | None = None, limit: int = 0) -> list[Any]:
        out: list[Any] = self._call("list_prefix", prefix, start_after=start_after, limit=limit)
        return out

    def commit(self, writes: Sequence[Any], *, fence: Any = None) -> bool:
        return bool(self._call("commit", writes, fence=fence))

    def put(self, key: str, value: bytes, *, lease_id: int = 0) -> None:
        self._call("put", key, value, lease_id=lease_id)

    def lease_grant(self, ttl_s: int) -> int:
        return int(self._call("lease_grant", ttl_s))

    def lease_refresh(self, lease_id: int) -> bool:
        return bool(self._call("lease_refresh", lease_id))

    def lease_revoke(self, lease_id: int) -> None:
        self._call("lease_revoke", lease_id)

    def healthy(self) -> bool:
        return bool(self._call("healthy"))
