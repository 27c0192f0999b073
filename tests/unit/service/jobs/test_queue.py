"""The local scheduler's queue, decided with plain values: who starts, who grows, who waits and
why (:func:`service.jobs.queue.place`), and the state machine following a grant."""

from __future__ import annotations

import pytest

from service.jobs.machine import Observation, confirm_launch, reconcile, request_cancel, request_scale
from service.jobs.model import JobState, NodeStatus
from service.jobs.queue import BACKFILL_FOR_S, Demand, Grant, check, demand, grant_all, place, still_waiting
from service.jobs.slots import stop_all
from tests.unit.service.jobs.test_job_machine import job, launched
from worker.errors import SpecError
from worker.jobspec.spec import parse_spec


def waiting(
    job_id: str, *, at: float, nproc: int = 1, lo: int = 1, hi: int | None = None, priority: int = 0
) -> Demand:
    return Demand(job_id, priority, at, nproc, lo, hi or lo, waiting_since=at)


def running(job_id: str, *, members: int, nproc: int = 1, lo: int = 1, hi: int | None = None, spares: int = 0,
            held_spares: int = 0) -> Demand:  # fmt: skip
    return Demand(job_id, 0, 0.0, nproc, lo, hi or members, spares, members, held_spares, started=True)


def started(grants: dict[str, Grant]) -> set[str]:
    return {job_id for job_id, g in grants.items() if g.position is None and g.members > 0}


def test_jobs_start_by_priority_then_by_submission() -> None:
    jobs = [
        waiting("old", at=1.0, nproc=2),
        waiting("new-urgent", at=3.0, nproc=2, priority=5),
        waiting("newer", at=2.0, nproc=2),
    ]
    grants = place(jobs, slots=4, now=10.0)
    assert started(grants) == {"new-urgent", "old"}
    assert grants["newer"] == Grant(0, 0, 1, grants["newer"].waiting)
    assert "waits for 2 free slots" in (grants["newer"].waiting or "") and "0 of 4" in (
        grants["newer"].waiting or ""
    )


def test_a_job_starts_only_when_its_minimum_fits_and_a_smaller_one_behind_it_backfills() -> None:
    jobs = [running("busy", members=1), waiting("big", at=1.0, nproc=2, lo=2), waiting("small", at=2.0)]
    grants = place(jobs, slots=4, now=10.0)  # 3 free: big needs 4, small needs 1
    assert grants["big"].members == 0 and grants["big"].position == 1
    assert "waits for 4 free slots" in (grants["big"].waiting or "") and "3 of 4" in (
        grants["big"].waiting or ""
    )
    assert grants["small"] == Grant(1, 0)
    assert grants["busy"] == Grant(1, 0)


def test_a_big_job_that_waited_long_enough_stops_the_backfill() -> None:
    big = waiting("big", at=1.0, nproc=2, lo=2)
    jobs = [running("busy", members=1), big, waiting("small", at=2.0)]
    grants = place(jobs, slots=4, now=1.0 + BACKFILL_FOR_S)
    assert grants["small"].members == 0 and grants["small"].position == 2
    assert "behind job big" in (grants["small"].waiting or "")


def test_an_elastic_job_starts_as_big_as_fits_and_grows_as_slots_free() -> None:
    grants = place([running("other", members=2), waiting("elastic", at=1.0, lo=1, hi=4)], slots=4, now=5.0)
    assert grants["elastic"].members == 2 and "runs 2 of its 4" in (grants["elastic"].waiting or "")
    # the other job ended: the elastic job grows to its desired size
    grown = place([running("elastic", members=2, hi=4)], slots=4, now=6.0)
    assert grown["elastic"] == Grant(4, 0)


def test_a_scale_up_beyond_the_free_slots_waits_and_grows_no_further_than_fits() -> None:
    grants = place([running("a", members=1, hi=3, nproc=2), running("b", members=1, nproc=2)], slots=5, now=0)
    assert grants["a"].members == 1  # 1 slot free: a node of 2 processes does not fit
    assert "2 more need 4 free slots" in (grants["a"].waiting or "") and "1 of 5 slots" in (
        grants["a"].waiting or ""
    )


def test_no_running_job_grows_into_the_slots_a_queued_job_waits_for() -> None:
    jobs = [running("elastic", members=1, hi=4), waiting("gang", at=1.0, lo=4)]
    grants = place(jobs, slots=4, now=2.0)
    assert grants["elastic"].members == 1 and "jobs wait in the queue" in (grants["elastic"].waiting or "")
    assert grants["gang"].position == 1


def test_spares_count_as_slots() -> None:
    jobs = [running("peer", members=1, nproc=2, spares=1, held_spares=1), waiting("next", at=1.0, nproc=2)]
    grants = place(jobs, slots=4, now=2.0)  # the member and the spare hold all 4
    assert grants["next"].members == 0 and grants["next"].position == 1
    fresh = place([running("peer", members=1, nproc=2, spares=1)], slots=4, now=2.0)
    assert fresh["peer"].spares == 1  # a free place: the spare is launched
    full = place(
        [running("peer", members=1, nproc=2, spares=1), running("x", members=1, nproc=2)], slots=4, now=2.0
    )
    assert full["peer"].spares == 0  # no room for it


def test_a_running_job_gets_back_to_its_minimum_before_anything_starts() -> None:
    jobs = [running("hurt", members=1, lo=2, nproc=2), waiting("next", at=1.0, nproc=2)]
    grants = place(jobs, slots=4, now=2.0)
    assert grants["hurt"].members == 2 and grants["next"].members == 0


def test_a_minimum_larger_than_every_slot_is_refused_at_submit() -> None:
    spec = parse_spec({"name": "x", "model": {"name": "mlp"}, "data": {"name": "synthetic"},
                       "micro_batch_size": 8, "max_steps": 5, "nodes": "3:4",
                       "nproc_per_node": 2})  # fmt: skip
    check(spec, 6)
    with pytest.raises(
        SpecError, match=r"'nodes'.*3 node.*2 process.*6 worker processes.*at most 5.*ELASTRAIN_LOCAL_SLOTS"
    ):
        check(spec, 5)


# -- the state machine follows the grant ------------------------------------------------------


def test_a_job_without_room_waits_queued_with_its_place_and_why() -> None:
    grant = Grant(0, 0, 2, "waits for 2 free slots")
    decision = reconcile(job(), Observation(now=1.0, grant=grant))
    assert decision.actions == () and not decision.job.nodes
    queued = decision.job
    assert queued.state == JobState.QUEUED and queued.queue_position == 2
    assert queued.waiting == "waits for 2 free slots" == queued.reason
    again = reconcile(queued, Observation(now=2.0, grant=Grant(0, 0, 1, "waits for 2 free slots"))).job
    assert again.state == JobState.QUEUED and again.queue_position == 1
    start = reconcile(again, Observation(now=3.0, grant=Grant(1, 0))).job
    assert start.state == JobState.LAUNCHING and len(start.members) == 1
    assert start.queue_position is None and start.waiting is None


def test_a_queued_job_cancels_without_ever_launching() -> None:
    queued = reconcile(job(), Observation(now=1.0, grant=Grant(0, 0, 1, "waits"))).job
    decision = reconcile(request_cancel(queued, 2.0), Observation(now=3.0, grant=Grant(0, 0, 1, "waits")))
    assert decision.job.state == JobState.CANCELLED and decision.actions == () and not decision.job.nodes


def test_a_job_granted_less_than_desired_runs_at_that_size_and_grows_later() -> None:
    first = reconcile(job(desired=3), Observation(now=1.0, grant=Grant(1, 0, None, "runs 1 of its 3"))).job
    record = first
    assert len(record.members) == 1
    handles = {n.launch_id: NodeStatus("running") for n in record.members}
    for node in record.members:
        record, _ = confirm_launch(record, node.launch_id, f"h-{node.index}", 2.0)
    up = reconcile(
        record, Observation(now=3.0, statuses=handles, grant=Grant(1, 0, None, "runs 1 of its 3"))
    ).job
    assert up.state == JobState.RUNNING and up.waiting == "runs 1 of its 3"
    grown = reconcile(up, Observation(now=4.0, statuses=handles, grant=Grant(3, 0))).job
    assert len(grown.members) == 3 and grown.state == JobState.RESCALING


def test_a_scale_request_beyond_the_grant_waits_instead_of_failing() -> None:
    record = launched(job(desired=1))
    statuses = {n.launch_id: NodeStatus("running") for n in record.members}
    scaled = request_scale(record, 3, 5.0)
    decision = reconcile(
        scaled, Observation(now=6.0, statuses=statuses, grant=Grant(1, 0, None, "runs 1 of its 3"))
    )
    assert decision.actions == () and decision.job.state == JobState.RUNNING
    assert decision.job.desired_nodes == 3 and decision.job.waiting == "runs 1 of its 3"


def test_a_records_demand_counts_what_it_holds_and_a_cancelled_job_wants_nothing() -> None:
    record = launched(job(desired=2))
    assert demand(record) == Demand("j-1", 0, 0.0, 1, 1, 2, 0, 2, 0, started=True, waiting_since=0.0)
    cancelling = demand(request_cancel(record, 2.0))
    assert cancelling.min_nodes == cancelling.desired_nodes == 0 and cancelling.members == 2
    stopping = demand(stop_all(record, 3.0)[0])
    assert stopping.members == 0 and stopping.stopping == 2 and stopping.held == 2  # still held
    assert not demand(job()).started


def test_a_finished_job_holds_its_slots_until_its_nodes_are_stopped() -> None:
    done = launched(job(desired=2)).model_copy(update={"state": JobState.CANCELLED})
    stopping, _ = stop_all(done, 5.0)  # both nodes are being stopped
    queued = job().model_copy(update={"id": "j-2", "created_at": 1.0, "desired_nodes": 1})
    assert grant_all([stopping, queued], slots=2, now=6.0)["j-2"].members == 0
    gone = done.model_copy(update={"nodes": ()})
    assert grant_all([gone, queued], slots=2, now=6.0) == {"j-2": Grant(1, 0)}


def test_a_queued_job_with_nothing_new_is_skipped_by_a_pass() -> None:
    queued = reconcile(job(), Observation(now=1.0, grant=Grant(0, 0, 1, "waits"))).job
    assert still_waiting(queued, Grant(0, 0, 1, "waits"))
    assert not still_waiting(queued, Grant(0, 0, 2, "waits"))  # its place changed: written
    assert not still_waiting(queued, Grant(1, 0))  # it starts
    assert not still_waiting(request_cancel(queued, 2.0), Grant(0, 0, 1, "waits"))  # it cancels
    assert not still_waiting(job(), Grant(0, 0, 1, "waits"))  # PENDING: it is queued first
