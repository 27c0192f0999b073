"""Recovery records tell the truth (pure rules, plain values): a stopped member failed at its last
sign of life, not when the survivors noticed; a restore from storage says how many bytes it read;
``step_before`` is the step the group had reached as its workers count it, not the service's
newest progress (which lags by up to its reporting period)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.jobs.cadence import HEARTBEAT_S
from service.jobs.events import WorkerEvent, apply_worker_event
from service.jobs.incidents import last_sign, step_reached
from service.jobs.model import JobRecord, JobState
from tests.unit.service.jobs.test_incidents import POLICY, Step, run, running_job, worker
from tests.unit.service.jobs.test_jobs_progress import setup
from worker.peer.loop import step_before

S = JobState


def report(now: float, *, heard: dict[str, float], progress_at: float = 100.0, **fields: Any) -> Step:
    """A peer-mode ``recovery`` report as the service folds it, with its view of the heartbeats."""
    event = WorkerEvent(kind="recovery", rank=0, recovery_kind="peer", lost=["j-n1-a0"], **fields)
    return lambda record: apply_worker_event(
        record, event, now, progress_at=progress_at, window_s=POLICY.merge_window_s, heard=heard
    )


def incident(*, failed_at: float, heard: dict[str, float], **more: Any) -> JobRecord:
    """A peer incident the survivors noticed at ``failed_at`` (their own time: they saw no EOF),
    repaired at 170 and stepping at 171."""
    common = {"incident": "j/g5", "failed_at": failed_at, "step": 40} | more
    started = report(170.0, heard=heard, phase="started", detected_at=failed_at, formed_at=169.0, **common)
    done = report(171.5, heard=heard, phase="done", first_step_at=171.0, **common)
    return run(running_job("peer"), [started, done])


def test_the_workers_measure_stands_unless_the_service_heard_nothing_for_longer_than_a_beat() -> None:
    assert last_sign(160.0, None) == 160.0
    assert last_sign(160.0, 160.0 - HEARTBEAT_S) == 160.0  # a crash: the EOF is the better measure
    assert last_sign(160.0, 100.5) == 100.5  # silent for a minute before it was noticed
    assert last_sign(160.0, 165.0) == 160.0  # heard after the failure (it came back): no news


def test_a_stopped_member_failed_at_its_last_heartbeat_not_at_detection() -> None:
    """Node 1's worker stopped (SIGSTOP) at about 100; the survivors noticed at 160 (their
    collective timed out) and were training again at 171: a 71 s recovery, not 11 s."""
    record = incident(failed_at=160.0, heard={"j-n1-a0": 100.5, "j-n0-a0": 169.0})
    (recovery,) = record.recoveries
    assert recovery.failed_at == 100.5 and recovery.detected_at == 160.0
    assert recovery.seconds == 171.0 - 100.5
    assert recovery.failed_at <= recovery.detected_at <= recovery.first_step_at  # type: ignore[operator]


def test_the_groups_progress_is_a_later_sign_of_life_than_an_old_heartbeat() -> None:
    """Every step needs every rank: the newest progress (at 100) says the stopped member was
    alive then, though its last heartbeat came at 96."""
    record = incident(failed_at=160.0, heard={"j-n1-a0": 96.0})
    assert record.recoveries[0].failed_at == 100.0


def test_a_crashed_member_keeps_the_workers_measure() -> None:
    """A member that died closed its connection at 160.2 (the workers' measure); the service
    heard from it 3 s before: within a beat, so the measure stands."""
    record = incident(failed_at=160.2, heard={"j-n1-a0": 157.2})
    assert record.recoveries[0].failed_at == 160.2


def test_step_before_is_the_step_the_workers_had_reached() -> None:
    """The service's newest progress said 1,900; the workers had committed 3,000 and restored
    the checkpoint of step 2,000 from storage: 1,000 steps lost, not a negative or a stale count."""
    stale = running_job("peer").model_copy(update={"last_step": 1900})
    common = {"incident": "j/g5", "recovery_kind": "storage", "failed_at": 199.0, "step": 2000}
    started = worker(200.0, "recovery", phase="started", step_before=3000, bytes_from_storage=4096, **common)
    done = worker(201.0, "recovery", phase="done", first_step_at=200.9, step_before=3000, **common)
    (recovery,) = run(stale, [started, done]).recoveries
    assert (recovery.step_before, recovery.resumed_step, recovery.steps_lost) == (3000, 2000, 1000)
    assert recovery.bytes_from_storage == 4096


def test_a_peer_recovery_that_lost_nothing_loses_no_step() -> None:
    """Progress every 25 steps said 75; the group had reached 100 and resumed there."""
    stale = running_job("peer").model_copy(update={"last_step": 75})
    common = {"incident": "j/g5", "recovery_kind": "peer", "failed_at": 199.0, "step": 100}
    done = worker(201.0, "recovery", phase="done", first_step_at=200.9, step_before=100, **common)
    (recovery,) = run(stale, [done]).recoveries
    assert (recovery.step_before, recovery.resumed_step, recovery.steps_lost) == (100, 100, 0)


def test_restart_mode_takes_the_step_a_stopping_rank_reported() -> None:
    """Rank 0 died; rank 1 reported its failure at step 3,000 while the newest progress said
    1,900. The group re-formed, loaded step 2,000 from storage (4 KiB) and stepped."""
    record = running_job().model_copy(update={"last_step": 1900})
    failed = worker(101.0, "failed", step=3000, group_id="a0", message="RuntimeError: peer closed")
    formed = worker(108.0, "group_formed", group_id="g2", world_size=2)
    loaded = worker(109.0, "state_loaded", step=2000, bytes_from_storage=4096)
    first = worker(113.0, "first_step", step=2001)
    record = run(record, [failed])
    assert step_reached(record) == 3000 and record.state == S.RUNNING
    record = run(record, [formed, loaded, first])
    (recovery,) = record.recoveries
    assert (recovery.step_before, recovery.resumed_step, recovery.steps_lost) == (3000, 2000, 1000)
    assert recovery.bytes_from_storage == 4096
    assert record.reached_step is None, "the new group counts from its own start"


def test_the_leaders_count_is_the_step_before_only_if_it_trained_in_the_failed_group() -> None:
    assert step_before(3000, 2000, True) == 3000
    assert step_before(90, 100, True) == 100  # never below the step resumed from
    assert step_before(0, 2000, False) is None  # a spare's own count says nothing of the group
    assert step_before(None, 2000, True) is None


def test_a_nodes_quietest_rank_is_its_last_sign_of_life(tmp_path: Path) -> None:
    """Two ranks on a node; rank 1 stops beating at +5 s, rank 0 goes on."""
    parts, _, clock, job_id = setup(tmp_path)
    start = clock.now
    for second in range(0, 30, 5):
        clock.now = start + second
        parts.heartbeats.beat(job_id, "launch-a", 0, step=second)
        if second <= 5:
            parts.heartbeats.beat(job_id, "launch-a", 1, step=second)
    assert parts.heartbeats.quietest(job_id) == {"launch-a": start + 5}
    assert parts.heartbeats.seen(job_id)[1] == {"launch-a": start + 25}  # the newest, as before
