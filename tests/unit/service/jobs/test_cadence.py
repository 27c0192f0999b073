"""How often the service asks its workers to call: the fastest periods for a small service,
longer as the ranks grow, never so long that a live node beats fewer than three times within
the heartbeat timeout; and the answers to workers carry them."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.jobs.cadence import HEARTBEATS_PER_S, Cadence, cadence_for, cadence_of
from service.jobs.model import JobState
from tests.unit.service.api.test_callbacks_inline import Leader
from tests.unit.service.jobs.test_job_machine import job, launched
from tests.unit.service.reconciler.test_reconciler import World


def test_a_small_service_keeps_the_fastest_periods() -> None:
    assert cadence_for(20, 2, heartbeat_timeout_s=60) == Cadence(heartbeat_s=5.0, progress_s=2.0)
    assert cadence_for(0, 0, heartbeat_timeout_s=60) == Cadence(heartbeat_s=5.0, progress_s=2.0)


@pytest.mark.parametrize("ranks", [2_000, 4_000, 6_000])
def test_past_the_budget_the_period_holds_the_heartbeats_a_second(ranks: int) -> None:
    periods = cadence_for(ranks, ranks // 10, heartbeat_timeout_s=60)
    assert ranks / periods.heartbeat_s == pytest.approx(min(ranks / 5.0, HEARTBEATS_PER_S))


def test_a_live_node_beats_three_times_within_the_timeout_however_many_ranks() -> None:
    periods = cadence_for(10_000, 1_000, heartbeat_timeout_s=60)
    assert periods == Cadence(heartbeat_s=20.0, progress_s=10.0)
    assert cadence_for(1_000_000, 100_000, heartbeat_timeout_s=60).heartbeat_s == 20.0
    assert cadence_for(10_000, 1_000, heartbeat_timeout_s=6).heartbeat_s == 5.0  # never faster


def test_progress_is_never_asked_for_less_often_than_heartbeats() -> None:
    periods = cadence_for(3_000, 3_000, heartbeat_timeout_s=60)
    assert periods.progress_s == periods.heartbeat_s == 7.5


def test_only_the_active_nodes_of_jobs_that_run_count() -> None:
    two = launched(job(desired=2))  # two nodes of one process
    queued = job(JobState.QUEUED, desired=4)
    ended = launched(job(desired=3)).model_copy(update={"state": JobState.SUCCEEDED})
    many = [two.model_copy(update={"id": f"j-{i}"}) for i in range(2_000)]  # 4,000 ranks
    assert cadence_of(many + [queued] * 5_000 + [ended] * 5_000, heartbeat_timeout_s=60) == cadence_for(
        4_000, 2_000, heartbeat_timeout_s=60
    )


def test_each_full_pass_of_the_leader_sets_the_periods(tmp_path: Path) -> None:
    world = World(tmp_path)
    world.submit(nodes="2")
    world.parts.heartbeats.cadence = Cadence(heartbeat_s=20.0, progress_s=10.0)  # as for 10,000 ranks
    reconciler = world.reconciler()
    assert reconciler.run_once()  # one job of two ranks: a small service
    assert world.parts.heartbeats.cadence == Cadence(heartbeat_s=5.0, progress_s=2.0)
    assert reconciler.metrics.heartbeat_period._value.get() == 5.0


def test_every_answer_to_a_worker_carries_the_periods(tmp_path: Path) -> None:
    leader = Leader(tmp_path)
    with leader.client:
        job_id, worker = leader.job()
        leader.parts.heartbeats.cadence = Cadence(heartbeat_s=12.5, progress_s=4.0)
        beat = {"launch_id": f"{job_id}-n0-a0", "local_rank": 0, "step": 1}
        answer = leader.client.post(f"/v1/jobs/{job_id}/workers/heartbeat", json=beat, headers=worker)
        event = {"kind": "log", "node_index": 0, "rank": 0, "message": "hello"}
        logged = leader.client.post(f"/v1/jobs/{job_id}/workers/events", json=event, headers=worker)
    for reply in (answer, logged):
        assert reply.status_code == 200, reply.text
        assert (reply.json()["heartbeat_s"], reply.json()["progress_s"]) == (12.5, 4.0)
