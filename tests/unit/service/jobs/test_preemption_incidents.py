"""A graceful stop on request (SIGTERM) is a preemption, not a crash, on the pure machine: the
workers' ``preempted`` report turns the node losses or the group re-formation that follow into
one incident of kind ``preemption`` that uses no restart, resumes from the step they saved (0
steps lost), and relaunches the lost node at once; a stop the service asked for (a cancel) is no
incident, and a later crash is a crash again."""

from __future__ import annotations

import pytest

from service.jobs.machine import Launch, Observation, reconcile
from service.jobs.model import JobState, NodePhase, NodeStatus, RecoveryMode
from tests.unit.service.jobs.test_incidents import (
    POLICY,
    node_lost,
    run,
    running_job,
    statuses,
    worker,
)

S = JobState
PREEMPTED = worker(100.5, "preempted", step=40, message="SIGTERM received; saved in 0.1 s")


def test_a_preempted_node_is_relaunched_at_once_without_using_a_restart() -> None:
    record = run(running_job(), [PREEMPTED])
    decision = reconcile(
        record,
        Observation(now=101.5, statuses=statuses(record, j_n1_a0=NodeStatus("failed", 1, ended_at=101.0))),
        POLICY,
    )
    (recovery,) = decision.job.recoveries
    assert recovery.kind == "preemption" and not recovery.charged and recovery.step_before == 40
    assert decision.job.restarts == 0 and decision.job.preemptions == 1
    assert decision.job.state == S.RECOVERING
    relaunched = [a.node.launch_id for a in decision.actions if isinstance(a, Launch)]
    assert relaunched == ["j-n1-a1"], decision.actions


@pytest.mark.parametrize("mode", ["restart", "peer"])
def test_a_whole_job_preempted_is_one_incident_that_loses_no_step(mode: RecoveryMode) -> None:
    """In peer mode too: no worker reports a peer recovery (none survived), and yet the
    relaunched group's first step uses no restart."""
    record = run(
        running_job(mode),
        [
            PREEMPTED,
            node_lost(101.5, launch="j-n1-a0", ended_at=101.0),
            node_lost(102.0, launch="j-n0-a0", ended_at=101.2),
            worker(108.0, "group_formed", group_id="g2", world_size=2),
            worker(109.0, "state_loaded", step=40),
            worker(110.0, "first_step", step=41),
        ],
    )
    (recovery,) = record.recoveries
    assert recovery.kind == "preemption" and set(recovery.lost) == {"j-n0-a0", "j-n1-a0"}
    assert recovery.steps_lost == 0 and record.restarts == 0 and record.state == S.RUNNING
    assert not recovery.charged, recovery


def test_workers_preempted_under_a_living_agent_re_form_without_using_a_restart() -> None:
    """Restart mode, a SIGTERM to the workers only: they save and exit, their torchrun agent
    starts the group again."""
    record = run(
        running_job(),
        [PREEMPTED, worker(103.0, "group_formed", group_id="g2", world_size=2)],
    )
    (recovery,) = record.recoveries
    assert recovery.kind == "preemption" and record.restarts == 0 and record.state == S.RECOVERING


def test_after_a_preemption_a_crash_is_a_crash_again() -> None:
    record = run(
        running_job(),
        [
            PREEMPTED,
            worker(103.0, "group_formed", group_id="g2", world_size=2),
            worker(104.0, "first_step", step=41),
            node_lost(400.0, ended_at=399.0),
        ],
    )
    assert [r.kind for r in record.recoveries] == ["preemption", "restart"] and record.restarts == 1


def test_a_stop_no_incident_followed_is_forgotten_at_the_next_first_step() -> None:
    record = run(running_job(), [PREEMPTED, worker(104.0, "first_step", step=41)])
    record = run(record, [node_lost(400.0, ended_at=399.0)])
    assert [r.kind for r in record.recoveries] == ["restart"] and record.restarts == 1


def test_a_cancelled_job_records_the_stop_but_opens_no_incident() -> None:
    record = running_job().model_copy(update={"cancel_requested": True})
    record = run(record, [PREEMPTED])
    assert record.preempted_step is None and any(e.kind == "preempted" for e in record.events)
    assert all(n.phase != NodePhase.FAILED for n in record.nodes)


# ---------------------------------------------------------------------------- peer mode

HANDED_OFF = worker(100.5, "preempted", step=40, message="SIGTERM received; rank 1 left without a save")
SURVIVORS_REFORMED = worker(
    100.7, "recovery", phase="done", incident="j/g2", recovery_kind="peer", lost=("j-n1-a0",),
    lost_ranks=(1,), failed_at=100.6, formed_at=100.65, first_step_at=100.7, step=40, world_before=2,
    world_after=1,
)  # fmt: skip


def test_in_peer_mode_a_node_that_left_on_request_is_a_preemption_whatever_comes_first() -> None:
    """The leaving rank reports its stop; the survivors' leader reports the re-formation; the
    wrapper's end comes last or first: one incident, kind preemption, no restart, and none of
    recovery.max_incidents."""
    for steps in (
        [HANDED_OFF, node_lost(101.0, ended_at=100.8), SURVIVORS_REFORMED],
        [HANDED_OFF, SURVIVORS_REFORMED, node_lost(101.0, ended_at=100.8)],
    ):
        record = run(running_job("peer"), steps)
        assert [(r.kind, r.charged) for r in record.recoveries] == [("preemption", False)], record.recoveries
        assert record.restarts == 0 and record.preemptions == 1 and record.peer_incidents == 0
