"""Worker progress reaches etcd at most every ``progress_flush_s`` per job, yet reads see the
newest report; a recovering job's progress and a finished job's last report are written at once."""

from __future__ import annotations

import json
from pathlib import Path

from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.model import JobState, Progress
from service.jobs.service import JobService
from worker.spec import parse_spec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SPEC = {"name": "p", "model": {"name": "mlp"}, "data": {"name": "synthetic"}, "micro_batch_size": 4,
        "max_steps": 10}  # fmt: skip


def setup(tmp_path: Path) -> tuple[JobService, MemoryStore, Clock, str]:
    clock = Clock()
    store = MemoryStore()
    jobs = JobService(store, tmp_path, b"k" * 32, clock=clock, progress_flush_s=5.0)
    record, _ = jobs.create(parse_spec(SPEC))
    return jobs, store, clock, record.id


def stored_step(store: MemoryStore, job_id: str) -> int | None:
    found = store.get(keys.progress(job_id))
    return Progress.model_validate_json(found.value).step if found else None


def test_progress_is_written_at_most_every_flush_interval_but_read_fresh(tmp_path: Path) -> None:
    jobs, store, clock, job_id = setup(tmp_path)
    record = jobs.get(job_id)
    for step in range(1, 6):  # one report a second
        jobs.report_progress(record, Progress(step=step, time=clock.now))
        assert jobs.progress(job_id) == Progress(step=step, time=clock.now)  # reads see the newest
        clock.now += 1
    assert stored_step(store, job_id) == 1  # the first went to etcd, the next four were held
    jobs.report_progress(record, Progress(step=6, time=clock.now))
    assert stored_step(store, job_id) == 6  # five seconds on: written


def test_recovering_progress_is_written_at_once_and_finished_jobs_flush(tmp_path: Path) -> None:
    jobs, store, clock, job_id = setup(tmp_path)
    record = jobs.get(job_id)
    jobs.report_progress(record, Progress(step=1, time=clock.now))
    clock.now += 1
    recovering = record.model_copy(update={"state": JobState.RECOVERING})
    jobs.report_progress(recovering, Progress(step=2, time=clock.now))
    assert stored_step(store, job_id) == 2  # the first step after a resume ends a recovery
    clock.now += 1
    jobs.report_progress(record, Progress(step=3, time=clock.now))
    assert stored_step(store, job_id) == 2
    jobs.flush_progress(job_id)
    assert stored_step(store, job_id) == 3
    fresh = JobService(store, tmp_path, b"k" * 32)  # another instance, or this one restarted
    assert fresh.progress(job_id) == Progress(step=3, time=clock.now)


def test_heartbeats_reach_etcd_at_most_every_write_interval_per_rank(tmp_path: Path) -> None:
    jobs, store, clock, job_id = setup(tmp_path)
    jobs.heartbeat_write_s = 15.0

    def stored(rank: int) -> float | None:
        found = store.get(keys.heartbeat(job_id, "launch-a", rank))
        return json.loads(found.value)["time"] if found else None

    start = clock.now
    for _ in range(3):  # a beat every 5 s from two ranks
        jobs.heartbeat(job_id, "launch-a", 0, step=1)
        jobs.heartbeat(job_id, "launch-a", 1, step=1)
        clock.now += 5
    assert stored(0) == stored(1) == start  # the beats at +5 s and +10 s were held back
    jobs.heartbeat(job_id, "launch-a", 0, step=2)  # at +15 s: due, written
    assert stored(0) == start + 15
    assert stored(1) == start
    jobs.heartbeat(job_id, "launch-b", 0, step=0)  # a new launch's first beat goes at once
    assert store.get(keys.heartbeat(job_id, "launch-b", 0)) is not None
