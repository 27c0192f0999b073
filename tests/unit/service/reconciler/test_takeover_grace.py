"""A leader that takes over declares no node silent for one heartbeat timeout: the beats its
predecessor took but had not yet stored, or that reached no leader during the change, are not
evidence of a hung node."""

from __future__ import annotations

from pathlib import Path

from service.jobs.model import JobState
from tests.unit.service.reconciler.test_reconciler import World


def test_a_new_leader_waits_one_heartbeat_timeout_from_its_takeover(tmp_path: Path) -> None:
    world = World(tmp_path)
    job_id = world.submit(nodes="1")
    old = world.reconciler("old")
    old.run_once()
    old.run_once()
    world.parts.heartbeats.beat(job_id, f"{job_id}-n0-a0", 0, step=5)  # stored
    world.clock.advance(30)  # the old leader dies; its lease runs out
    new = world.reconciler("new")
    assert new.run_once()  # takes over 30 s after the stored beat
    for _ in range(8):  # 40 s on: 70 s after the stored beat, 40 s after the takeover
        world.clock.advance(5)
        new.election.keep_alive()
    assert new.run_once()
    assert world.jobs.get(job_id).state == JobState.RUNNING
    for _ in range(5):  # 65 s after the takeover, and still no beat: hung
        world.clock.advance(5)
        new.election.keep_alive()
    assert new.run_once()
    assert world.jobs.get(job_id).state == JobState.RECOVERING
