"""A pass woken by a job write reconciles that job and every job in motion at once; the steadily
running others wait for the next full pass (a write costs no full pass)."""

from __future__ import annotations

from pathlib import Path

from service.jobs.model import JobRecord, JobState
from service.jobs.queue import Grant
from service.reconciler import woken_pass_takes
from tests.unit.service.reconciler.test_reconciler import World


def running(world: World, count: int) -> list[str]:
    ids = [world.submit(nodes="1") for _ in range(count)]
    r = world.reconciler()
    r.run_once()
    r.run_once()
    assert all(world.jobs.get(job_id).state == JobState.RUNNING for job_id in ids)
    return ids


def test_a_woken_pass_takes_the_written_job_and_leaves_the_steady_ones_to_the_full_pass(
    tmp_path: Path,
) -> None:
    world = World(tmp_path)
    first, second = running(world, 2)
    for job_id in (first, second):
        world.parts.heartbeats.beat(job_id, f"{job_id}-n0-a0", 0, step=5)
    r = world.reconciler()
    r.run_once()
    for _ in range(24):  # both stop beating: hung after the heartbeat timeout
        world.clock.advance(5)
        r.election.keep_alive()
    assert r.run_once(only={first})
    assert world.jobs.get(first).state == JobState.RECOVERING
    assert world.jobs.get(second).state == JobState.RUNNING  # not looked at yet
    assert r.run_once()  # the full pass
    assert world.jobs.get(second).state == JobState.RECOVERING


def test_a_woken_pass_starts_a_new_job_whoever_was_written(tmp_path: Path) -> None:
    world = World(tmp_path)
    (steady,) = running(world, 1)
    fresh = world.submit(nodes="1")
    r = world.reconciler()
    r.run_once(only={steady})
    assert world.scheduler.launch_ids[-1] == f"{fresh}-n0-a0"


def test_what_a_woken_pass_takes() -> None:
    def job(state: JobState) -> JobRecord:
        return JobRecord.model_construct(id="j", state=state)

    grant = Grant(members=1, spares=0)
    assert woken_pass_takes(job(JobState.RUNNING), {"j"}, {}, {})
    assert not woken_pass_takes(job(JobState.RUNNING), {"other"}, {"j": grant}, {"j": grant})
    assert woken_pass_takes(job(JobState.RUNNING), {"other"}, {"j": grant}, {})  # its grant moved
    assert woken_pass_takes(job(JobState.RECOVERING), set(), {}, {})
    assert woken_pass_takes(job(JobState.QUEUED), set(), {}, {})
