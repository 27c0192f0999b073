"""Peer mode in the control plane, against the in-memory store and the fake scheduler:
which jobs run in it, the spares the reconciler keeps, the ``desired`` key the workers read, and
what a worker's recovery report may say."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.etcd.election import LeaderElection
from service.etcd.memory import MemoryStore
from service.jobs import keys, peer
from service.jobs.callbacks import check_event
from service.jobs.errors import InvalidRequestError
from service.jobs.events import WorkerEvent
from service.jobs.model import JobState, NodePhase
from service.jobs.parts import JobParts
from service.jobs.slots import spare_failure_limit
from service.reconciler import LaunchContext, Reconciler
from tests.specs import raw_spec
from tests.unit.service.svc_fakes import Clock, FakeScheduler, with_recovery
from worker.errors import SpecError
from worker.jobspec.spec import JobSpec, parse_spec

RAW: dict[str, Any] = raw_spec("peer", micro_batch_size=4, nodes="2", max_restarts=2)


def spec(**change: Any) -> JobSpec:
    return parse_spec(RAW | change)


@pytest.mark.parametrize(
    ("mode", "parallelism", "expected"),
    [
        ("peer", "ddp", "peer"),
        ("auto", "ddp", "peer"),
        ("auto", "fsdp", "restart"),
        ("restart", "ddp", "restart"),
    ],
)
def test_the_recovery_mode_follows_the_spec(mode: str, parallelism: str, expected: str) -> None:
    assert peer.recovery_mode(with_recovery(spec(parallelism=parallelism), mode=mode)) == expected


def test_a_spec_without_the_recovery_fields_gets_the_defaults() -> None:
    """A spec that names neither ``recovery`` nor ``spares``: ``auto`` (peer for DDP, restart for
    FSDP), no spares, no incident limit."""
    plain = spec()
    assert peer.recovery_mode(plain) == "peer" and peer.spares(plain) == 0
    assert peer.recovery_mode(spec(parallelism="fsdp")) == "restart"
    assert peer.max_incidents(plain) is None


def test_a_job_asking_for_gpus_recovers_by_restart_under_auto_and_says_why() -> None:
    """Peer recovery over NCCL is untested (it needs two GPUs): ``auto`` gives a job with
    ``resources.gpu`` the restart path, the submitted event says so, and ``peer`` by name still
    gets peer recovery."""
    gpu = spec(resources={"gpu": "1"})
    assert peer.recovery_mode(gpu) == "restart"
    assert "asks for GPUs (resources.gpu), and peer recovery over NCCL is untested" in peer.recovery_why(gpu)
    assert peer.recovery_mode(with_recovery(gpu, mode="peer")) == "peer"
    assert peer.recovery_mode(spec(resources={"gpu": "0"})) == "peer"
    with pytest.raises(SpecError, match=r"field 'spares'.*a job asking for GPUs under recovery\.mode 'auto'"):
        peer.check(with_recovery(gpu, mode="auto", spares=1))


def test_the_recovery_fields_are_bounded_and_named_in_errors() -> None:
    for change, field in [
        ({"spares": 65}, "spares"),
        ({"spares": -1}, "spares"),
        ({"recovery": {"mode": "sometimes"}}, "recovery.mode"),
        ({"recovery": {"collective_timeout_s": 0}}, "recovery.collective_timeout_s"),
        ({"recovery": {"max_incidents": 0}}, "recovery.max_incidents"),
        ({"recovery": {"replicas": 2}}, "recovery.replicas"),
    ]:
        with pytest.raises(SpecError, match=rf"field '{field}'"):
            spec(**change)
    assert spec(recovery={"max_incidents": 3}, spares=64).recovery.max_incidents == 3


def test_spares_need_peer_recovery() -> None:
    with pytest.raises(SpecError, match=r"field 'spares'.*recovery\.mode"):
        peer.check(with_recovery(spec(), mode="restart", spares=1))
    with pytest.raises(SpecError, match="FSDP"):
        peer.check(with_recovery(spec(parallelism="fsdp"), mode="auto", spares=2))
    peer.check(with_recovery(spec(), mode="peer", spares=2))


def test_replacing_stragglers_needs_peer_recovery() -> None:
    replace = {"stragglers": {"action": "replace"}}
    with pytest.raises(
        SpecError, match=r"^field 'stragglers\.action': 'replace' needs peer recovery.*'report'"
    ):
        peer.check(with_recovery(spec(**replace), mode="restart"))
    with pytest.raises(SpecError, match=r"field 'stragglers\.action'.*FSDP"):
        peer.check(with_recovery(spec(parallelism="fsdp", **replace), mode="auto"))
    peer.check(with_recovery(spec(**replace), mode="peer", spares=1))
    peer.check(with_recovery(spec(**replace), mode="auto"))  # a CPU DDP job: peer under auto


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.store = MemoryStore(clock=self.clock)
        self.parts = JobParts.build(self.store, storage_root=tmp_path, secret=b"k" * 32, clock=self.clock)
        self.jobs = self.parts.records
        self.scheduler = FakeScheduler()
        election = LeaderElection(self.store, "a", ttl_s=10, clock=self.clock)
        ctx = LaunchContext(service_url="http://svc:8080")
        self.reconciler = Reconciler(self.parts, self.scheduler, election, launch=ctx, clock=self.clock)

    def submit(self, job_spec: JobSpec) -> str:
        return self.jobs.create(job_spec)[0].id

    def desired(self, job_id: str) -> dict[str, int] | None:
        found = self.store.get(keys.group_desired(job_id))
        return None if found is None else json.loads(found.value)

    def active(self, job_id: str, role: str) -> list[str]:
        nodes = self.jobs.get(job_id).nodes
        return [n.launch_id for n in nodes if n.role == role and n.phase.active]


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_the_workers_are_told_the_desired_size_at_submit_and_every_scale(world: World) -> None:
    job_id = world.submit(with_recovery(spec(nodes="1:3", initial_nodes=2), spares=1))
    record = world.jobs.get(job_id)
    assert (record.recovery_mode, record.spares) == ("peer", 1)
    assert world.desired(job_id) == {"nodes": 2, "spares": 1, "epoch": 1}
    world.jobs.scale(job_id, 3)
    assert world.desired(job_id) == {"nodes": 3, "spares": 1, "epoch": 2}
    world.jobs.scale(job_id, 3)  # no change: nothing written
    assert world.desired(job_id) == {"nodes": 3, "spares": 1, "epoch": 2}
    world.jobs.cancel(job_id)
    world.reconciler.run_once()
    assert world.jobs.get(job_id).state == JobState.CANCELLED
    assert world.desired(job_id) is None  # deleted with the job's rendezvous keys


@pytest.mark.parametrize(
    ("parallelism", "mode", "says"),
    [
        ("ddp", "auto", "recovery peer: survivors keep their processes"),
        ("ddp", "restart", "recovery restart (recovery.mode is 'restart')"),
        ("fsdp", "auto", "recovery restart: FSDP state is sharded and no peer holds a lost rank's shard"),
    ],
)
def test_the_submitted_event_says_which_recovery_and_why(
    world: World, parallelism: str, mode: str, says: str
) -> None:
    job_id = world.submit(with_recovery(spec(parallelism=parallelism), mode=mode))
    (submitted,) = [e for e in world.jobs.get(job_id).events if e.kind == "submitted"]
    assert submitted.message.startswith("submitted with nodes 2; ") and says in submitted.message


def test_a_restart_mode_job_has_no_desired_key(world: World) -> None:
    job_id = world.submit(with_recovery(spec(nodes="1:3"), mode="restart"))
    world.jobs.scale(job_id, 2)
    assert world.desired(job_id) is None


def test_the_reconciler_launches_members_and_spares_in_peer_mode(world: World) -> None:
    job_id = world.submit(with_recovery(spec(), spares=1))
    world.reconciler.run_once()
    launches = {n.launch_id: n for n in world.scheduler.launches}
    assert list(launches) == [f"{job_id}-n0-a0", f"{job_id}-n1-a0", f"{job_id}-n2-a0"]
    assert [(n.recovery, n.role) for n in launches.values()] == [("peer", "member")] * 2 + [("peer", "spare")]
    world.reconciler.run_once()
    assert world.jobs.get(job_id).state == JobState.RUNNING


def test_a_lost_spare_is_replaced_without_an_incident_until_spares_keep_failing(world: World) -> None:
    job_id = world.submit(with_recovery(spec(), spares=1))
    world.reconciler.run_once()
    world.reconciler.run_once()
    for attempt in range(spare_failure_limit(world.jobs.get(job_id))):
        world.scheduler.finish(f"{job_id}-n2-a{attempt}", exit_code=1)
        world.reconciler.run_once()
        record = world.jobs.get(job_id)
        assert record.state == JobState.RUNNING and record.recoveries == () and record.restarts == 0
    assert world.active(job_id, "spare") == []  # given up: the job trains on without a spare
    assert any("spare" in e.message for e in world.jobs.get(job_id).events)


def test_a_finished_training_stops_the_spares(world: World) -> None:
    job_id = world.submit(with_recovery(spec(), spares=1))
    world.reconciler.run_once()
    world.reconciler.run_once()
    world.scheduler.finish(f"{job_id}-n2-a0", exit_code=0)  # a spare told to leave: not the job's end
    world.reconciler.run_once()
    assert world.jobs.get(job_id).state == JobState.RUNNING and world.active(job_id, "spare") == [
        f"{job_id}-n2-a1"
    ]
    world.reconciler.run_once()
    for index in (0, 1):
        world.scheduler.finish(f"{job_id}-n{index}-a0", exit_code=0)
    world.reconciler.run_once()
    record = world.jobs.get(job_id)
    assert record.state == JobState.SUCCEEDED
    assert [n.phase for n in record.nodes if n.launch_id == f"{job_id}-n2-a1"] == [NodePhase.STOPPING]
    assert f"fake://{job_id}-n2-a1" in world.scheduler.cancelled


def test_a_promoted_spare_is_relabeled_and_a_new_spare_launched(world: World) -> None:
    job_id = world.submit(with_recovery(spec(), spares=1))
    world.reconciler.run_once()
    world.reconciler.run_once()
    world.scheduler.finish(f"{job_id}-n1-a0", exit_code=137)  # the agent of slot 1 is killed
    promoted = WorkerEvent(kind="spare_promoted", rank=1, launch_id=f"{job_id}-n2-a0", node_index=1)
    world.jobs.worker_event(job_id, promoted)
    world.reconciler.run_once()
    assert world.active(job_id, "member") == [f"{job_id}-n0-a0", f"{job_id}-n2-a0"]
    assert world.active(job_id, "spare") == [f"{job_id}-n2-a1"]
    assert world.jobs.worker_event(job_id, promoted) == world.jobs.get(job_id)  # told twice: no change


def event(**fields: Any) -> WorkerEvent:
    return WorkerEvent(kind="recovery", phase="started", incident="x/g1", recovery_kind="peer", **fields)


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        (event(failed_at=1.0), "failed_at"),  # long before the job was created (at 1000)
        (event(first_step_at=10_000.0), "first_step_at"),  # far ahead of now (1100)
        (event(lost_ranks=(0, 2)), "lost_ranks"),  # the job has at most 2 ranks
        (event(world_after=3), "world_after"),
        (WorkerEvent(kind="spare_promoted", launch_id="x", node_index=2), "node_index"),  # no slot 2
        (WorkerEvent(kind="log", node_index=3), "node_index"),  # 2 slots + 1 spare place
    ],
)
def test_a_recovery_report_the_job_cannot_have_is_refused_naming_the_field(
    world: World, bad: WorkerEvent, field: str
) -> None:
    record = world.jobs.get(world.submit(with_recovery(spec(), spares=1)))
    with pytest.raises(InvalidRequestError) as refused:
        check_event(record, bad, now=1100.0)
    assert refused.value.field == field
    check_event(record, WorkerEvent(kind="log", node_index=2), now=1100.0)  # the spare's own index
    check_event(record, event(failed_at=1050.0, lost_ranks=(1,), world_after=2), now=1100.0)


def test_the_api_takes_the_contracts_recovery_report_and_refuses_what_is_out_of_bounds() -> None:
    from pydantic import ValidationError

    from service.api.schemas import WorkerEventRequest

    report = {
        "kind": "recovery", "rank": 0, "phase": "done", "incident": "j/g5", "recovery_kind": "peer",
        "lost": ["j-n1-a0"], "lost_ranks": [1], "failed_at": 1700000000, "detected_at": 1700000000.01,
        "formed_at": 1700000000.04, "transferred_at": 1700000000.09, "first_step_at": 1700000000.15,
        "source_rank": 0, "bytes_from_peers": 4800000, "bytes_from_storage": 0, "voided_windows": 1,
        "world_before": 2, "world_after": 2, "step": 40,
    }  # fmt: skip
    parsed = WorkerEventRequest.model_validate_json(json.dumps(report))
    assert parsed.lost == ["j-n1-a0"] and parsed.failed_at == 1700000000.0
    promoted = {"kind": "spare_promoted", "rank": 1, "launch_id": "j-n2-a0", "node_index": 1}
    assert WorkerEventRequest.model_validate_json(json.dumps(promoted)).launch_id == "j-n2-a0"
    for bad in (
        {"recovery_kind": "magic"},
        {"phase": "halfway"},
        {"failed_at": "1700000000"},
        {"lost": ["j-n1-a0"] * 65},
        {"lost_ranks": [-1]},
        {"bytes_from_peers": -1},
        {"incident": "a b"},
        {"world_after": 0},
    ):
        with pytest.raises(ValidationError):
            WorkerEventRequest.model_validate_json(json.dumps(report | bad))
    with pytest.raises(ValidationError):
        WorkerEventRequest.model_validate_json(json.dumps(report).replace("1700000000.15", "NaN"))
