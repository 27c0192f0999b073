"""One incident = one recovery, on the pure machine: a lost node and the group
re-formation it causes, or a lost node and the workers' recovery report, are one recovery in
whatever order they arrive, timed from the lost node's last sign of life to the repaired group's
first step; restart-mode recoveries use a restart, peer ones do not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from service.api.schemas import recovery_public
from service.jobs.events import WorkerEvent, apply_worker_event, first_step_done
from service.jobs.machine import Launch, Observation, Policy, confirm_launch, reconcile, request_scale
from service.jobs.model import JobRecord, JobState, NodePhase, NodeStatus, RecoveryMode
from service.jobs.recovery import phases_of
from tests.specs import make_spec

SPEC = make_spec("j", micro_batch_size=1, max_steps=1)
S = JobState
POLICY = Policy(heartbeat_timeout_s=60.0)  # a completed incident takes late news for 120 s
Step = Callable[[JobRecord], JobRecord]


def running_job(
    mode: RecoveryMode = "restart", *, nodes: tuple[int, int, int] = (2, 1, 2), spares: int = 0, **more: Any
) -> JobRecord:
    """A job whose nodes (and spares) were launched at t=1 and train: RUNNING at step 40."""
    desired, lo, hi = nodes
    record = JobRecord(
        id="j",
        name="j",
        spec=SPEC,
        spec_hash="h",
        state_since=0.0,
        desired_nodes=desired,
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=1,
        max_restarts=3,
        checkpoint_dir="/c",
        worker_token_hash="x",
        created_at=0.0,
        updated_at=0.0,
        recovery_mode=mode,
        spares=spares,
        **more,
    )
    record = launch_all(record, 1.0)
    record = reconcile(record, Observation(now=1.0, statuses=statuses(record)), POLICY).job
    record = apply_worker_event(
        record, WorkerEvent(kind="group_formed", group_id="g1", world_size=desired), 2.0
    )
    assert record.state == S.RUNNING
    return record.model_copy(update={"last_step": 40})


def launch_all(record: JobRecord, now: float) -> JobRecord:
    decision = reconcile(record, Observation(now=now, statuses=statuses(record)), POLICY)
    record = decision.job
    for action in decision.actions:
        if isinstance(action, Launch):
            record, wanted = confirm_launch(record, action.node.launch_id, f"h-{action.node.launch_id}", now)
            assert wanted
    return record


def statuses(record: JobRecord, **ended: NodeStatus) -> dict[str, NodeStatus]:
    out = {n.launch_id: NodeStatus("running") for n in record.nodes if n.phase == NodePhase.RUNNING}
    return out | {k.replace("_", "-"): v for k, v in ended.items()}


def node_lost(now: float, *, ended_at: float | None = 101.0, launch: str = "j-n1-a0", **obs: Any) -> Step:
    """The reconciler sees node ``launch``'s agent ended (at ``ended_at``, as its scheduler
    recorded it), ``now``."""

    def step(record: JobRecord) -> JobRecord:
        gone = {launch.replace("-", "_"): NodeStatus("failed", 137, ended_at=ended_at)}
        decision = reconcile(record, Observation(now=now, statuses=statuses(record, **gone), **obs), POLICY)
        return launch_all(decision.job, now)

    return step


def worker(now: float, kind: str, **fields: Any) -> Step:
    return lambda record: apply_worker_event(
        record,
        WorkerEvent(kind=kind, rank=0, **fields),
        now,
        progress_at=100.0,
        window_s=POLICY.merge_window_s,
    )  # type: ignore[arg-type]


def progress(now: float, step: int, world_size: int = 2) -> Step:
    return lambda record: first_step_done(record, step, now, world_size=world_size)


def run(record: JobRecord, steps: list[Step]) -> JobRecord:
    for step in steps:
        record = step(record)
    return record


# ---------------------------------------------------------------------------- restart mode

GROUP = worker(108.0, "group_formed", group_id="g2", world_size=2)
FIRST = worker(113.0, "first_step", step=31)
RESTART_ORDERS = {
    "node, group, first step": [node_lost(101.5), GROUP, FIRST],
    "group, node, first step": [GROUP, node_lost(109.0), FIRST],
    "group, first step, node": [GROUP, FIRST, node_lost(114.0)],
}


@pytest.mark.parametrize("order", list(RESTART_ORDERS))
def test_a_lost_agent_and_the_reformation_it_causes_are_one_recovery(order: str) -> None:
    """The issue's case: node 1's torchrun agent SIGKILLed at t=101 (2 nodes x 1 process), the
    group re-formed at 108 and stepped at 113. Whatever the service hears first, the record shows
    one recovery of 12 s (not two of 0.47 s and 0.06 s), using one restart."""
    record = run(running_job(), RESTART_ORDERS[order])
    assert len(record.recoveries) == 1, record.recoveries
    (recovery,) = record.recoveries
    assert (recovery.kind, recovery.lost, recovery.failed_at) == ("restart", ("j-n1-a0",), 101.0)
    assert recovery.seconds == 12.0 and recovery.group_formed_at == 108.0
    assert record.restarts == 1 and record.state in (S.RUNNING, S.RESCALING)
    phases = phases_of(recovery)
    assert phases[-1].name.endswith("first_step") and sum(p.seconds for p in phases) == 12.0


def test_a_silent_node_is_timed_from_its_newest_heartbeat_or_the_groups_progress() -> None:
    """Without an end time from the scheduler (a node gone silent), its last sign of life is the
    later of its newest heartbeat and the group's newest progress (every step needs every rank)."""
    record = running_job()
    seen = {"j-n0-a0": 170.0, "j-n1-a0": 99.0}
    decision = reconcile(
        record,
        Observation(now=170.0, statuses=statuses(record), last_seen=seen, last_heard=seen, progress_at=100.0),
        POLICY,
    )
    (recovery,) = decision.job.recoveries
    assert recovery.failed_at == 100.0 and recovery.detected_at == 170.0
    assert [n.phase for n in decision.job.nodes if n.launch_id == "j-n1-a0"] == [NodePhase.LOST]


def test_a_node_lost_long_after_an_incident_is_a_new_one() -> None:
    record = run(running_job(), [GROUP, FIRST, node_lost(113.0 + 121.0, ended_at=233.0)])
    assert len(record.recoveries) == 2 and record.restarts == 2


def test_a_node_that_was_in_the_repaired_group_is_a_new_incident() -> None:
    """Its agent ended after the repaired group formed: a failure of its own."""
    record = run(running_job(), [GROUP, FIRST, node_lost(114.0, ended_at=112.0)])
    assert len(record.recoveries) == 2


def test_a_growing_reformation_is_a_join_not_a_failure() -> None:
    record = run(running_job(nodes=(1, 1, 2)), [worker(5.0, "group_formed", group_id="g2", world_size=2)])
    assert record.recoveries == () and record.state == S.RESCALING and record.restarts == 0


def test_a_replacement_that_fails_during_the_incident_costs_a_restart_of_it() -> None:
    record = run(running_job(), [node_lost(101.5)])
    replacement = next(n for n in record.nodes if n.launch_id == "j-n1-a1")
    assert replacement.phase == NodePhase.RUNNING
    record = run(record, [node_lost(105.0, launch="j-n1-a1", ended_at=104.0)])
    assert len(record.recoveries) == 1 and record.recoveries[0].lost == ("j-n1-a0", "j-n1-a1")
    assert record.restarts == 2


# ---------------------------------------------------------------------------- peer mode

INCIDENT = "j/g5"
STARTED = worker(
    200.06, "recovery", phase="started", incident=INCIDENT, recovery_kind="peer", lost=("j-n1-a0",),
    lost_ranks=(1,), failed_at=200.01, detected_at=200.02, formed_at=200.05, step=40, world_before=2,
    world_after=2,
)  # fmt: skip
PROMOTED = worker(200.06, "spare_promoted", launch_id="j-n2-a0", node_index=1)
DONE = worker(
    200.16, "recovery", phase="done", incident=INCIDENT, recovery_kind="peer", lost=("j-n1-a0",),
    failed_at=200.01, transferred_at=200.09, first_step_at=200.15, bytes_from_peers=4_800_000,
    voided_windows=1, step=40,
)  # fmt: skip
NODE = node_lost(200.5, ended_at=200.0)
EARLY_NODE = node_lost(200.03, ended_at=200.0)
PEER_ORDERS = {
    "reports, then the node": [STARTED, PROMOTED, DONE, NODE],
    "node, then reports": [EARLY_NODE, STARTED, PROMOTED, DONE],
    "started, node, promoted, done": [STARTED, EARLY_NODE, PROMOTED, DONE],
    "done before started": [PROMOTED, DONE, STARTED, NODE],
}


@pytest.mark.parametrize("order", list(PEER_ORDERS))
def test_a_peer_recovery_with_a_spare_is_one_incident_in_any_order(order: str) -> None:
    record = running_job("peer", nodes=(2, 2, 2), spares=1)
    assert [n.launch_id for n in record.nodes if n.role == "spare"] == ["j-n2-a0"]
    record = run(record, PEER_ORDERS[order])
    (recovery,) = record.recoveries
    assert (recovery.kind, recovery.reported, recovery.incident) == ("peer", True, INCIDENT)
    assert recovery.failed_at == 200.01 and recovery.seconds == pytest.approx(0.14)
    assert recovery.lost == ("j-n1-a0",) and recovery.lost_ranks == (1,)
    assert (recovery.bytes_from_peers, recovery.voided_windows, recovery.steps_lost) == (4_800_000, 1, 0)
    assert record.restarts == 0 and record.peer_incidents == 1 and record.state == S.RUNNING
    members = {n.index: n.launch_id for n in record.nodes if n.role == "member" and n.phase.active}
    assert members == {0: "j-n0-a0", 1: "j-n2-a0"}  # the spare is the member of slot 1
    spares = [n for n in record.nodes if n.role == "spare" and n.phase.active]
    assert len(spares) == 1 and spares[0].index == 2  # and the pool is full again
    launched = {n.launch_id for n in record.nodes} - {"j-n0-a0", "j-n1-a0", "j-n2-a0"}
    assert len(launched) == 1  # one new node app: a new spare, or a replacement that became one


def test_a_failure_is_never_recorded_after_its_detection() -> None:
    """A report whose lost member's end came late (its connection closed after the survivors'
    collectives had already failed): the incident starts at the detection, not after it."""
    late = worker(
        200.60, "recovery", phase="started", incident=INCIDENT, recovery_kind="peer", lost=("j-n1-a0",),
        lost_ranks=(1,), failed_at=200.55, detected_at=200.06, formed_at=200.58, step=40,
    )  # fmt: skip
    record = run(running_job("peer", nodes=(2, 2, 2), spares=1), [late, PROMOTED, DONE])
    (recovery,) = record.recoveries
    assert recovery.failed_at == 200.01 and recovery.detected_at == 200.06  # DONE's earlier failure
    record = run(running_job("peer", nodes=(2, 2, 2), spares=1), [late])
    assert record.recoveries[0].failed_at == 200.06


def test_a_peer_incident_without_spares_waits_for_a_replacement_in_the_slot() -> None:
    record = run(running_job("peer", nodes=(2, 2, 2)), [NODE])
    assert record.state == S.RECOVERING and record.restarts == 0
    assert [n.launch_id for n in record.nodes if n.phase.active and n.index == 1] == ["j-n1-a1"]
    record = run(record, [STARTED, DONE])
    assert len(record.recoveries) == 1 and record.recoveries[0].kind == "peer" and record.state == S.RUNNING


def test_a_service_closed_incident_is_claimed_by_the_late_report_and_its_restart_given_back() -> None:
    """The group's progress ended the incident before the workers' report came: until then it
    counted as a restart; the report makes it the peer recovery it was."""
    record = run(running_job("peer", nodes=(2, 1, 2)), [EARLY_NODE, progress(200.3, 41, world_size=1)])
    assert record.state == S.RUNNING and record.restarts == 1 and record.recoveries[0].kind == "restart"
    record = run(record, [STARTED, DONE])
    (recovery,) = record.recoveries
    assert recovery.kind == "peer" and recovery.first_step_at == 200.15 and record.restarts == 0


def test_a_peer_incident_no_worker_reports_was_a_restart() -> None:
    record = run(running_job("peer"), [EARLY_NODE, worker(206.0, "first_step", step=33)])
    (recovery,) = record.recoveries
    assert recovery.kind == "restart" and not recovery.reported and record.restarts == 1


def test_progress_from_before_the_repair_does_not_end_a_reported_recovery() -> None:
    record = run(running_job("peer"), [STARTED, progress(200.07, 40)])
    assert record.state == S.RECOVERING
    assert run(record, [progress(200.2, 41)]).state == S.RUNNING


def test_a_scale_down_is_not_an_incident() -> None:
    record = request_scale(running_job("peer"), 1, now=150.0)
    record = reconcile(record, Observation(now=150.0, statuses=statuses(record)), POLICY).job
    assert [n.phase for n in record.nodes if n.index == 1] == [NodePhase.STOPPING]
    record = run(record, [STARTED, DONE])
    assert record.recoveries == () and record.state == S.RESCALING


def test_more_peer_incidents_than_the_circuit_breaker_allows_fail_the_job() -> None:
    record = run(running_job("peer", max_incidents=1), [STARTED, DONE])
    assert record.state == S.RUNNING
    second = worker(
        300.0, "recovery", phase="started", incident="j/g9", recovery_kind="peer", lost=("j-n0-a0",)
    )
    record = run(record, [second])
    assert record.state == S.FAILED and "max_incidents" in (record.reason or "")


def test_a_recovery_reported_for_no_known_node_still_records_it() -> None:
    done = worker(
        250.0, "recovery", phase="done", incident="j/g7", recovery_kind="storage", lost=("not-a-node",),
        lost_ranks=(1,), failed_at=249.0, first_step_at=249.9, bytes_from_storage=1024,
    )  # fmt: skip
    record = run(running_job("peer"), [done])
    (recovery,) = record.recoveries
    assert recovery.kind == "storage" and recovery.lost == () and recovery.bytes_from_storage == 1024
    assert record.state == S.RUNNING and record.restarts == 0


def test_completed_recoveries_are_handed_to_the_metrics_once() -> None:
    record = run(running_job("peer"), [STARTED, DONE])
    decision = reconcile(record, Observation(now=201.0, statuses=statuses(record)), POLICY)
    assert [r.incident for r in decision.completed] == [INCIDENT]
    again = reconcile(decision.job, Observation(now=202.0, statuses=statuses(decision.job)), POLICY)
    assert again.completed == ()


def test_a_peer_incident_carries_the_last_step_each_lost_rank_completed() -> None:
    """A hung rank's recovery report names the step it completed (its beacon's); the incident
    keeps it through the report's ``done`` (which repeats only what changed), and the API shows it."""
    started = worker(
        200.06, "recovery", phase="started", incident=INCIDENT, recovery_kind="peer", lost=("j-n1-a0",),
        lost_ranks=(1,), last_completed_steps={"1": 39}, failed_at=200.01, detected_at=200.02, step=40,
    )  # fmt: skip
    record = run(running_job("peer", nodes=(2, 1, 2)), [started, DONE])
    (recovery,) = record.recoveries
    assert recovery.lost_ranks == (1,) and recovery.last_completed_steps == {"1": 39}
    assert recovery_public(recovery).last_completed_steps == {"1": 39}
    with pytest.raises(ValueError, match="last_completed_steps"):
        WorkerEvent(kind="recovery", last_completed_steps={"rank one": 3})
