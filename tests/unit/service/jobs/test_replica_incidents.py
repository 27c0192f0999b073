"""A silent corruption under the service: the workers' ``replica_mismatch`` report is in the
job's events (the step, the ranks, the tensors), and the ranks' ``failed`` reports that follow
open one restart incident that names the ranks that disagreed."""

from __future__ import annotations

from tests.unit.service.jobs.test_incidents import run, running_job, worker

LINE = "data-parallel replicas disagree after step 44: both ranks, in net.0.weight"
MISMATCH = worker(100.4, "replica_mismatch", step=44, message=LINE)
FAILED = worker(
    100.5, "failed", step=44, group_id="a1", lost_ranks=[0, 1],
    message=f"error: {LINE}; nothing was saved: the newest published checkpoint is kept",
)  # fmt: skip
REFORMED = worker(103.0, "group_formed", group_id="g2", world_size=2)


def test_the_mismatch_is_an_event_of_the_job_and_its_restart_names_the_ranks() -> None:
    record = run(running_job(), [MISMATCH, FAILED, REFORMED])
    assert [e.message for e in record.events if e.kind == "replica_mismatch"] == [LINE]
    (recovery,) = record.recoveries
    assert recovery.kind == "restart" and recovery.lost_ranks == (0, 1)
    assert any("nothing was saved" in e.message for e in record.events)
