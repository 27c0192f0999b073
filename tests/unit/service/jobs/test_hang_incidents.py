"""A hang, named: the ranks a worker's timed-out collective waited for (its ``failed`` report)
are the ``lost_ranks`` of the incident it causes, whether the report comes before the group
re-forms or after."""

from __future__ import annotations

from tests.unit.service.jobs.test_incidents import run, running_job, worker

TIMED_OUT = worker(
    100.5, "failed", step=41, group_id="a1", lost_ranks=[1],
    message="error: timed out; the collective waited for rank 1 (last completed step 41, not running)",
)  # fmt: skip
REFORMED = worker(103.0, "group_formed", group_id="g2", world_size=2)


def test_the_incident_after_a_timed_out_collective_names_the_ranks_it_waited_for() -> None:
    record = run(running_job(), [TIMED_OUT, REFORMED])
    (recovery,) = record.recoveries
    assert recovery.lost_ranks == (1,) and record.waited_for == ()
    assert any("waited for rank 1" in e.message for e in record.events)


def test_a_report_that_comes_after_the_reformation_names_them_too() -> None:
    record = run(running_job(), [REFORMED, TIMED_OUT])
    (recovery,) = record.recoveries
    assert recovery.lost_ranks == (1,)
