"""The job state machine, with plain values: every transition, and the illegal ones."""

from __future__ import annotations

import pytest

from service.jobs.events import WorkerEvent, apply_worker_event, merge_progress
from service.jobs.machine import (
    ALLOWED,
    Cancel,
    IllegalTransitionError,
    Launch,
    Observation,
    Policy,
    confirm_launch,
    launch_failed,
    move,
    reconcile,
    request_cancel,
    request_scale,
)
from service.jobs.model import JobRecord, JobState, NodePhase, NodeStatus, Progress
from tests.specs import make_spec

SPEC = make_spec("j", micro_batch_size=1, max_steps=1)

S = JobState


def job(
    state: JobState = S.PENDING, *, desired: int = 2, lo: int = 1, hi: int = 4, restarts: int = 3
) -> JobRecord:
    return JobRecord(
        id="j-1",
        name="j",
        spec=SPEC,
        spec_hash="h",
        state=state,
        state_since=0.0,
        desired_nodes=desired,
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=1,
        max_restarts=restarts,
        checkpoint_dir="/ckpt/j-1",
        worker_token_hash="x",
        created_at=0.0,
        updated_at=0.0,
    )


def launched(record: JobRecord, now: float = 1.0) -> JobRecord:
    """Run the first decision and confirm every launch, as the reconciler would."""
    decision = reconcile(record, Observation(now=now))
    record = decision.job
    for action in decision.actions:
        assert isinstance(action, Launch)
        record, wanted = confirm_launch(record, action.node.launch_id, f"h-{action.node.launch_id}", now)
        assert wanted
    return reconcile(record, Observation(now=now, statuses=running(record))).job


def running(record: JobRecord) -> dict[str, NodeStatus]:
    return {n.launch_id: NodeStatus("running") for n in record.nodes if n.phase == NodePhase.RUNNING}


def test_pending_launches_desired_nodes_and_records_intent() -> None:
    decision = reconcile(job(), Observation(now=1.0))
    assert decision.job.state == S.LAUNCHING
    assert [type(a) for a in decision.actions] == [Launch, Launch]
    assert [n.phase for n in decision.job.nodes] == [NodePhase.LAUNCHING] * 2
    assert [n.launch_id for n in decision.job.nodes] == ["j-1-n0-a0", "j-1-n1-a0"]


def test_all_launches_confirmed_is_running() -> None:
    record = launched(job())
    assert record.state == S.RUNNING
    assert all(n.handle for n in record.nodes)


def test_orphaned_launch_intent_is_launched_again_with_the_same_id() -> None:
    record = reconcile(job(), Observation(now=1.0)).job  # crashed before confirming
    again = reconcile(record, Observation(now=2.0))
    assert [a.node.launch_id for a in again.actions if isinstance(a, Launch)] == ["j-1-n0-a0", "j-1-n1-a0"]
    assert len(again.job.nodes) == 2


def test_adopted_running_nodes_are_not_launched_again() -> None:
    record = launched(job())
    decision = reconcile(record, Observation(now=5.0, statuses=running(record)))
    assert decision.actions == ()
    assert decision.job.state == S.RUNNING


def test_node_failure_relaunches_the_slot_and_counts_a_restart() -> None:
    record = launched(job())
    statuses = running(record) | {"j-1-n1-a0": NodeStatus("failed", 1)}
    decision = reconcile(record, Observation(now=5.0, statuses=statuses))
    assert decision.job.state == S.RECOVERING
    assert decision.job.restarts == 1
    assert [a.node.launch_id for a in decision.actions if isinstance(a, Launch)] == ["j-1-n1-a1"]
    assert "exit code 1" in (decision.job.reason or "")


def test_failure_with_no_restarts_left_fails_and_stops_the_rest() -> None:
    record = launched(job(restarts=0))
    statuses = running(record) | {"j-1-n0-a0": NodeStatus("failed", 137)}
    decision = reconcile(record, Observation(now=5.0, statuses=statuses))
    assert decision.job.state == S.FAILED
    assert "max_restarts" in (decision.job.reason or "")
    assert [a.node.launch_id for a in decision.actions if isinstance(a, Cancel)] == ["j-1-n1-a0"]


def test_silent_node_is_lost_cancelled_and_replaced() -> None:
    record = launched(job())
    seen = {"j-1-n0-a0": 100.0, "j-1-n1-a0": 10.0}
    decision = reconcile(record, Observation(now=100.0, statuses=running(record), last_seen=seen))
    lost = [n for n in decision.job.nodes if n.phase == NodePhase.LOST]
    assert [n.launch_id for n in lost] == ["j-1-n1-a0"]
    assert {type(a) for a in decision.actions} == {Cancel, Launch}
    assert decision.job.state == S.RECOVERING


def test_a_new_leader_gives_a_silent_node_one_heartbeat_timeout_from_its_takeover() -> None:
    record = launched(job())
    seen = {"j-1-n0-a0": 100.0, "j-1-n1-a0": 10.0}  # n1's newer beats went to the old leader
    policy = Policy(heartbeat_timeout_s=60)
    early = Observation(now=100.0, statuses=running(record), last_seen=seen, led_since=90.0)
    assert reconcile(record, early, policy).job.state == S.RUNNING
    late = Observation(now=151.0, statuses=running(record), last_seen=seen, led_since=90.0)
    lost = [n.launch_id for n in reconcile(record, late, policy).job.nodes if n.phase == NodePhase.LOST]
    assert lost == ["j-1-n1-a0"]


def test_running_node_without_heartbeats_is_trusted_to_the_scheduler() -> None:
    record = launched(job())
    decision = reconcile(record, Observation(now=10_000.0, statuses=running(record)))
    assert decision.job.state == S.RUNNING and decision.actions == ()


def test_unknown_node_with_fresh_heartbeats_is_kept() -> None:
    record = launched(job())
    seen = {n.launch_id: 990.0 for n in record.nodes}
    decision = reconcile(record, Observation(now=1000.0, last_seen=seen), Policy(heartbeat_timeout_s=60))
    assert decision.job.state == S.RUNNING and decision.actions == ()


def test_success_of_any_node_finishes_when_the_rest_end() -> None:
    record = launched(job())
    first = reconcile(
        record, Observation(now=5.0, statuses=running(record) | {"j-1-n0-a0": NodeStatus("succeeded")})
    )
    assert first.job.state == S.RUNNING and first.actions == ()
    second = reconcile(first.job, Observation(now=6.0, statuses={"j-1-n1-a0": NodeStatus("succeeded")}))
    assert second.job.state == S.SUCCEEDED
    assert second.job.finished_at == 6.0


def test_scale_up_and_down_while_running() -> None:
    record = request_scale(launched(job()), 3, now=2.0)
    up = reconcile(record, Observation(now=3.0, statuses=running(record)))
    assert up.job.state == S.RESCALING
    assert [a.node.index for a in up.actions if isinstance(a, Launch)] == [2]
    record = request_scale(up.job, 1, now=4.0)
    down = reconcile(record, Observation(now=5.0, statuses=running(record)))
    stopped = [a.node.index for a in down.actions if isinstance(a, Cancel)]
    assert stopped == [1]  # index 2 was never confirmed: it is dropped without a cancel
    assert len(down.job.active_nodes) == 1


def test_stopping_node_is_cancelled_until_it_is_gone() -> None:
    record = request_scale(launched(job()), 1, now=2.0)
    first = reconcile(record, Observation(now=3.0, statuses=running(record))).job
    again = reconcile(first, Observation(now=4.0, statuses={"j-1-n1-a0": NodeStatus("running")}))
    assert [type(a) for a in again.actions] == [Cancel]
    done = reconcile(again.job, Observation(now=5.0, statuses={"j-1-n1-a0": NodeStatus("failed", -15)}))
    assert done.actions == ()
    assert [n.phase for n in done.job.nodes] == [NodePhase.RUNNING, NodePhase.STOPPED]
    assert done.job.restarts == 0


@pytest.mark.parametrize("nodes", [0, 5])
def test_scale_outside_range_is_refused(nodes: int) -> None:
    with pytest.raises(IllegalTransitionError, match=r"within the job's range 1:4") as info:
        request_scale(job(S.RUNNING), nodes, now=1.0)
    assert info.value.code == "out_of_range"


@pytest.mark.parametrize("state", [S.SUCCEEDED, S.FAILED, S.CANCELLED])
def test_finished_job_cannot_be_scaled_and_cancel_is_a_no_op(state: JobState) -> None:
    record = job(state)
    with pytest.raises(IllegalTransitionError) as info:
        request_scale(record, 2, now=1.0)
    assert info.value.code == "job_finished"
    assert request_cancel(record, now=1.0) is record


def test_cancel_stops_every_node_and_is_idempotent() -> None:
    record = request_cancel(launched(job()), now=2.0)
    assert request_cancel(record, now=3.0) is record
    decision = reconcile(record, Observation(now=4.0, statuses=running(record)))
    assert decision.job.state == S.CANCELLED
    assert sorted(a.node.index for a in decision.actions if isinstance(a, Cancel)) == [0, 1]


def test_cancel_pending_job_needs_no_action() -> None:
    decision = reconcile(request_cancel(job(), now=1.0), Observation(now=2.0))
    assert decision.job.state == S.CANCELLED and decision.actions == ()


def test_terminal_job_never_changes_state() -> None:
    record = job(S.SUCCEEDED)
    decision = reconcile(record, Observation(now=9.0))
    assert decision.job.state == S.SUCCEEDED and decision.actions == ()


@pytest.mark.parametrize("source", list(S))
@pytest.mark.parametrize("target", list(S))
def test_move_follows_the_transition_table(source: JobState, target: JobState) -> None:
    record = job(source)
    if target == source or target in ALLOWED[source]:
        assert move(record, target, now=1.0).state == target
    else:
        with pytest.raises(IllegalTransitionError, match=f"cannot go from {source} to {target}"):
            move(record, target, now=1.0)


def test_confirm_launch_of_a_node_stopped_meanwhile_asks_for_cancel() -> None:
    record = reconcile(job(desired=1), Observation(now=1.0)).job
    record = request_scale(record.model_copy(update={"min_nodes": 0}), 0, now=1.5)
    record = reconcile(record, Observation(now=2.0)).job
    _, wanted = confirm_launch(record, "j-1-n0-a0", "h", now=3.0)
    assert not wanted


def test_worker_restart_opens_and_first_step_closes_a_recovery() -> None:
    record = launched(job())
    record = apply_worker_event(record, WorkerEvent(kind="group_formed", group_id="g1", world_size=2), 2.0)
    record = record.model_copy(update={"last_step": 40})
    assert record.state == S.RUNNING and record.restarts == 0
    formed = WorkerEvent(kind="group_formed", group_id="g2", world_size=2)
    record = apply_worker_event(record, formed, 10.0, progress_at=8.0)
    assert record.state == S.RECOVERING and record.restarts == 1
    assert apply_worker_event(record, formed, 11.0) == record  # duplicate report
    record = apply_worker_event(record, WorkerEvent(kind="state_loaded", step=30), 12.0)
    record = apply_worker_event(record, WorkerEvent(kind="first_step", step=31), 14.0)
    assert record.state == S.RUNNING
    recovery = record.recoveries[-1]
    # timed from the old group's last sign of life, its newest progress
    assert recovery.failed_at == 8.0 and recovery.seconds == 6.0 and recovery.kind == "restart"
    assert recovery.steps_lost == 10 and recovery.state_loaded_at == 12.0


def test_merged_progress_sets_the_step_a_recovery_counts_from() -> None:
    record = launched(job())
    record = apply_worker_event(record, WorkerEvent(kind="group_formed", group_id="g1", world_size=2), 2.0)
    assert merge_progress(record, None) is record
    progress = Progress(step=40, world_size=2, time=5.0)
    merged = merge_progress(record, progress)
    assert merged.last_step == 40 and merged.world_size == 2
    assert merge_progress(merged, progress) is merged  # nothing new: the same record, no write
    assert merge_progress(merged, Progress(step=41, time=6.0)).world_size == 2  # kept when unreported
    formed = WorkerEvent(kind="group_formed", group_id="g2", world_size=2)
    recovering = apply_worker_event(merged, formed, 10.0)
    recovering = apply_worker_event(recovering, WorkerEvent(kind="first_step", step=31), 14.0)
    assert recovering.recoveries[-1].steps_lost == 10  # 40 reached, resumed at 30


def test_rescale_ends_on_first_step_without_counting_a_restart() -> None:
    record = request_scale(launched(job()), 3, now=2.0)
    record = reconcile(record, Observation(now=3.0, statuses=running(record))).job
    record = apply_worker_event(record, WorkerEvent(kind="group_formed", group_id="a", world_size=3), 4.0)
    record = apply_worker_event(record, WorkerEvent(kind="first_step", step=5), 5.0)
    assert record.state == S.RUNNING and record.restarts == 0 and record.world_size == 3


def test_worker_events_on_finished_job_change_nothing() -> None:
    record = job(S.CANCELLED)
    assert apply_worker_event(record, WorkerEvent(kind="first_step", step=1), 1.0) is record


def test_launch_refused_by_the_scheduler_counts_as_a_failure() -> None:
    record = reconcile(job(restarts=1), Observation(now=1.0)).job
    record = launch_failed(record, "j-1-n0-a0", "image not found", now=2.0)
    assert record.restarts == 1 and record.state == S.RECOVERING
    assert "could not be launched: image not found" in (record.reason or "")
    again = reconcile(record, Observation(now=3.0))
    assert [a.node.launch_id for a in again.actions if isinstance(a, Launch)] == ["j-1-n1-a0", "j-1-n0-a1"]
    record = launch_failed(again.job, "j-1-n0-a1", "image not found", now=4.0)
    assert record.state == S.FAILED
    assert "image not found" in (record.reason or "") and "max_restarts" in (record.reason or "")


def test_launch_ids_are_never_reused_after_old_nodes_are_pruned() -> None:
    record = launched(job(desired=1, restarts=100))
    seen = {n.launch_id for n in record.nodes}
    for attempt in range(1, 30):
        failed = {n.launch_id: NodeStatus("failed", 1) for n in record.nodes if n.phase == NodePhase.RUNNING}
        decision = reconcile(record, Observation(now=float(attempt), statuses=failed))
        launches = [a.node.launch_id for a in decision.actions if isinstance(a, Launch)]
        assert launches == [f"j-1-n0-a{attempt}"] and not seen & set(launches)
        seen |= set(launches)
        record, _ = confirm_launch(decision.job, launches[0], f"h{attempt}", float(attempt))
    assert len(record.nodes) <= 17
    assert JobRecord.from_json(record.to_json()).next_attempt == {0: 30}


def test_a_rescale_ends_at_the_target_world_size_or_a_new_groups_first_step() -> None:
    """Until the new nodes join, the old group keeps training and reporting progress: that does
    not end the rescale. Progress at the target world size, or the first step a newly formed
    group reports, does."""
    from service.jobs.events import first_step_done

    scaling = job(S.RESCALING, desired=3).model_copy(update={"world_size": 2})
    assert first_step_done(scaling, 40, 5.0, world_size=2).state == S.RESCALING
    assert first_step_done(scaling, 60, 6.0, world_size=3).state == S.RUNNING
    event = WorkerEvent(kind="first_step", rank=0, step=61)
    assert apply_worker_event(scaling, event, 7.0).state == S.RUNNING
    recovering = job(S.RECOVERING, desired=3)
    assert first_step_done(recovering, 10, 5.0, world_size=2).state == S.RUNNING  # a recovery: any step
