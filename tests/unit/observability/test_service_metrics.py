"""The service's metrics (service.metrics) and the arithmetic behind them (service.jobs.recovery):
recovery phases, goodput, per-job series labelled job_id, and the instrumented store (over the
in-memory store)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.etcd.kv import Write
from service.etcd.memory import MemoryStore
from service.jobs.model import JobRecord, JobState, NodeRecord, Progress, Recovery
from service.jobs.recovery import estimated_goodput, goodput, recovery_phases
from service.metrics import InstrumentedStore, Metrics
from tests.specs import make_spec
from worker.etcdclient import EtcdUnavailableError

SPEC = make_spec("j", micro_batch_size=1, max_steps=1)


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
    peer = recovery_phases(
        failed_at=0, detected_at=0.01, group_formed_at=0.04, state_loaded_at=0.1, kind="peer"
    )
    assert [p.name for p in peer] == ["detect", "reform", "transfer"]  # a peer's state is transferred


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
        spec=SPEC,
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


def test_a_completed_recovery_observes_each_phase_by_kind_and_what_it_moved_and_lost() -> None:
    metrics = Metrics()
    registry = metrics.registry
    restart = Recovery(
        reason="r",
        failed_at=7.0,
        detected_at=10.0,
        step_before=30,
        group_formed_at=10.0,
        state_loaded_at=14.0,
        resumed_step=20,
        first_step_at=15.5,
        bytes_from_storage=4096,
    )
    metrics.observe_recovery("job-1", restart)
    name = "elastrain_job_recovery_phase_seconds_sum"
    assert sample(registry, name, phase="detect", kind="restart") == 3.0
    assert sample(registry, name, phase="reform", kind="restart") == 0.0
    assert sample(registry, name, phase="restore", kind="restart") == 4.0
    assert sample(registry, name, phase="first_step", kind="restart") == 1.5
    assert sample(registry, "elastrain_job_recovery_seconds_sum", kind="restart") == 8.5
    assert sample(registry, "elastrain_job_rollback_steps_total", job_id="job-1") == 10
    assert sample(registry, "elastrain_job_recovery_bytes_total", job_id="job-1", source="storage") == 4096
    peer = Recovery(
        reason="r",
        kind="peer",
        failed_at=100.0,
        detected_at=100.02,
        group_formed_at=100.05,
        state_loaded_at=100.09,
        first_step_at=100.15,
        step_before=40,
        resumed_step=40,
        bytes_from_peers=5_000_000,
        voided_windows=1,
    )
    metrics.observe_recovery("job-1", peer)
    assert sample(registry, "elastrain_job_recovery_seconds_count", kind="peer") == 1
    assert sample(registry, "elastrain_job_recovery_seconds_count", kind="restart") == 1
    assert sample(registry, "elastrain_job_recovery_phase_seconds_count", phase="transfer", kind="peer") == 1
    assert (
        sample(registry, "elastrain_job_recovery_phase_seconds_count", phase="restore", kind="peer") is None
    )
    assert sample(registry, "elastrain_job_recovery_bytes_total", job_id="job-1", source="peers") == 5_000_000
    assert sample(registry, "elastrain_job_voided_windows_total", job_id="job-1") == 1
    assert sample(registry, "elastrain_job_rollback_steps_total", job_id="job-1") == 10  # none rolled back


def test_job_series_are_labelled_job_id_follow_the_record_and_go_when_it_ends() -> None:
    metrics = Metrics()
    registry = metrics.registry
    nodes = (
        NodeRecord(index=0, launch_id="a", phase="running"),
        NodeRecord(index=1, launch_id="b", phase="failed"),
    )
    done = Recovery(reason="r", failed_at=50.0, step_before=10, resumed_step=10, first_step_at=60.0)
    running = record(nodes=nodes, recoveries=(done,), restarts=1, world_size=2)
    metrics.observe_job(running, Progress(step=7, samples_per_s=12.5, time=99.0), now=100.0)
    for name, value in [
        ("elastrain_job_nodes", 1),
        ("elastrain_job_goodput_ratio", pytest.approx(0.9)),
        ("elastrain_job_step", 7),
        ("elastrain_job_samples_per_second", 12.5),
        ("elastrain_job_world_size", 2),
        ("elastrain_job_restarts", 1),
    ]:
        assert sample(registry, name, job_id="job-1") == value, name
    page = metrics.render().decode()
    assert 'job="' not in page  # Prometheus owns `job`: a scrape would rename ours exported_job
    metrics.observe_job(record(state=JobState.SUCCEEDED), None, now=200.0)
    for name in ("elastrain_job_nodes", "elastrain_job_step", "elastrain_job_restarts"):
        assert sample(registry, name, job_id="job-1") is None, name


def test_the_world_size_gauge_follows_the_newest_progress() -> None:
    """After a scale-down the smaller group's progress says its size before the reconciler writes
    it into the record: the gauge says the same as the API's job view, not the record's old size."""
    metrics = Metrics()
    metrics.observe_job(record(world_size=3), Progress(step=12, world_size=1, time=99.0), now=100.0)
    assert sample(metrics.registry, "elastrain_job_world_size", job_id="job-1") == 1


def test_one_registry_per_app() -> None:
    first, second = Metrics(), Metrics()  # several apps in one process (tests) do not clash
    first.publish.observe(0.02)
    assert sample(first.registry, "elastrain_checkpoint_publish_duration_seconds_count") == 1
    assert sample(second.registry, "elastrain_checkpoint_publish_duration_seconds_count") == 0


def test_the_instrumented_store_counts_round_trips_and_keeps_semantics() -> None:
    metrics = Metrics()
    registry = metrics.registry
    store = InstrumentedStore(MemoryStore(), metrics)
    assert store.commit([Write("/k", b"v", 0)]) is True
    assert store.commit([Write("/k", b"w", 0)]) is False  # CAS still decides
    got = store.get("/k")
    assert got is not None and got.value == b"v"
    assert sample(registry, "elastrain_etcd_requests_total", op="commit", outcome="ok") == 2
    assert sample(registry, "elastrain_etcd_requests_total", op="get", outcome="ok") == 1
    assert sample(registry, "elastrain_etcd_request_duration_seconds_count", op="commit") == 2

    down = MemoryStore()
    down.available = False  # etcd without quorum
    other = Metrics()
    with pytest.raises(EtcdUnavailableError):
        InstrumentedStore(down, other).get("/k")
    assert sample(other.registry, "elastrain_etcd_requests_total", op="get", outcome="error") == 1
