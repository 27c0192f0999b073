"""service.observability: recovery phases, goodput, the missing service metrics on a registry,
and the instrumented store (over the in-memory store)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.api.metrics import Metrics
from service.etcd.client import EtcdUnavailableError
from service.etcd.kv import Write
from service.etcd.memory import MemoryStore
from service.jobs.model import JobRecord, JobState, NodeRecord, Recovery
from service.observability import (
    InstrumentedStore,
    ServiceObservability,
    estimated_goodput,
    goodput,
    recovery_phases,
)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return float(s.value)
    return None


def test_phases_merge_over_missing_stamps_and_stop_at_the_last_known() -> None:
    full = recovery_phases(failed_at=0, detected_at=1, group_formed_at=3, state_loaded_at=6, first_step_at=10)
    assert [(p.name, p.seconds) for p in full] == [
        ("detect", 1),
        ("reform", 2),
        ("restore", 3),
        ("first_step", 4),
    ]
    merged = recovery_phases(failed_at=0, state_loaded_at=6, first_step_at=7)
    assert [(p.name, p.seconds) for p in merged] == [("detect+reform+restore", 6), ("first_step", 1)]
    running = recovery_phases(failed_at=0, detected_at=2)
    assert [p.name for p in running] == ["detect"]
    noticed = recovery_phases(
        failed_at=5, detected_at=99, state_loaded_at=6, first_step_at=7, from_detection=True
    )
    assert [(p.name, p.seconds) for p in noticed] == [("reform+restore", 1), ("first_step", 1)]


def test_goodput_is_a_ratio_in_0_1() -> None:
    assert goodput(wall_seconds=100, productive_seconds=80) == 0.8
    assert goodput(wall_seconds=0, productive_seconds=1) is None
    assert goodput(wall_seconds=10, productive_seconds=20) == 1.0
    lost = estimated_goodput(wall_seconds=100, recovery_seconds=[10, 5], steps_lost=20, step_seconds=0.5)
    assert lost == pytest.approx(0.75)


def record(**over: object) -> JobRecord:
    base: dict[str, object] = dict(
        id="job-1",
        name="n",
        spec={},
        spec_hash="h",
        state=JobState.RUNNING,
        state_since=0.0,
        desired_nodes=2,
        min_nodes=1,
        max_nodes=2,
        nproc_per_node=1,
        max_restarts=3,
        checkpoint_dir="/c",
        worker_token_hash="x",
        created_at=0.0,
        updated_at=0.0,
    )
    return JobRecord.model_validate(base | over)


def test_a_completed_recovery_observes_each_phase_and_the_lost_steps() -> None:
    registry = CollectorRegistry()
    obs = ServiceObservability(registry)
    recovery = Recovery(
        reason="r",
        failed_at=10.0,
        step_before=30,
        group_formed_at=10.0,
        state_loaded_at=14.0,
        resumed_step=20,
        first_step_at=15.5,
    )
    obs.observe_recovery("job-1", recovery, last_seen_at=7.0)
    name = "elastrain_job_recovery_phase_seconds_sum"
    assert sample(registry, name, phase="detect") == 3.0
    assert sample(registry, name, phase="reform") == 0.0
    assert sample(registry, name, phase="restore") == 4.0
    assert sample(registry, name, phase="first_step") == 1.5
    assert sample(registry, "elastrain_job_rollback_steps_total", job_id="job-1") == 10
    obs.observe_recovery("job-2", recovery)  # without a last sign of life: no detect phase
    assert sample(registry, "elastrain_job_recovery_phase_seconds_count", phase="detect") == 1
    assert sample(registry, "elastrain_job_recovery_phase_seconds_count", phase="reform") == 2


def test_job_gauges_follow_the_record_and_go_when_it_ends() -> None:
    registry = CollectorRegistry()
    obs = ServiceObservability(registry)
    nodes = (
        NodeRecord(index=0, launch_id="a", phase="running"),
        NodeRecord(index=1, launch_id="b", phase="failed"),
    )
    done = Recovery(reason="r", failed_at=50.0, step_before=10, resumed_step=10, first_step_at=60.0)
    obs.observe_job(record(nodes=nodes, recoveries=(done,)), now=100.0)
    assert sample(registry, "elastrain_job_nodes", job_id="job-1") == 1
    assert sample(registry, "elastrain_job_goodput_ratio", job_id="job-1") == pytest.approx(0.9)
    obs.observe_job(record(state=JobState.SUCCEEDED), now=200.0)
    assert sample(registry, "elastrain_job_nodes", job_id="job-1") is None


def test_it_lives_beside_the_service_metrics_on_their_registry() -> None:
    metrics = Metrics()
    obs = metrics.obs  # Metrics registers the additions on its own registry, without clashes
    obs.observe_publish(0.02)
    assert sample(metrics.registry, "elastrain_checkpoint_publish_duration_seconds_count") == 1


def test_the_instrumented_store_counts_round_trips_and_keeps_semantics() -> None:
    registry = CollectorRegistry()
    store = InstrumentedStore(MemoryStore(), ServiceObservability(registry))
    assert store.commit([Write("/k", b"v", 0)]) is True
    assert store.commit([Write("/k", b"w", 0)]) is False  # CAS still decides
    got = store.get("/k")
    assert got is not None and got.value == b"v"
    assert sample(registry, "elastrain_etcd_requests_total", op="commit", outcome="ok") == 2
    assert sample(registry, "elastrain_etcd_requests_total", op="get", outcome="ok") == 1
    assert sample(registry, "elastrain_etcd_request_duration_seconds_count", op="commit") == 2

    class Down:
        def get(self, key: str) -> None:
            raise EtcdUnavailableError("no quorum")

    other = CollectorRegistry()
    with pytest.raises(EtcdUnavailableError):
        InstrumentedStore(Down(), ServiceObservability(other)).get("/k")
    assert sample(other, "elastrain_etcd_requests_total", op="get", outcome="error") == 1
