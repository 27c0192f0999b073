"""Worker progress reaches etcd at most every ``progress_flush_s`` per job, yet reads see the
newest report; a recovering job's progress and a finished job's last report are written at once;
a progress report after a re-formation ends the recovery. Heartbeats reach etcd at most every
write interval per rank."""

from __future__ import annotations

import json
from pathlib import Path

from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.model import JobState, Progress
from service.jobs.parts import JobParts
from service.jobs.progress import ProgressBuffer
from tests.specs import raw_spec
from worker.jobspec.spec import parse_spec


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


SPEC = raw_spec("p", micro_batch_size=4)  # fmt: skip


def setup(tmp_path: Path) -> tuple[JobParts, MemoryStore, Clock, str]:
    clock = Clock()
    store = MemoryStore()
    parts = JobParts.build(
        store,
        storage_root=tmp_path,
        secret=b"k" * 32,
        clock=clock,
        progress_flush_s=5.0,
        heartbeat_write_s=15.0,
    )
    record, _ = parts.records.create(parse_spec(SPEC))
    return parts, store, clock, record.id


def stored_step(store: MemoryStore, job_id: str) -> int | None:
    found = store.get(keys.progress(job_id))
    return Progress.model_validate_json(found.value).step if found else None


def test_progress_is_written_at_most_every_flush_interval_but_read_fresh(tmp_path: Path) -> None:
    parts, store, clock, job_id = setup(tmp_path)
    record = parts.records.get(job_id)
    for step in range(1, 6):  # one report a second
        parts.progress.report(record, Progress(step=step, time=clock.now))
        assert parts.progress.newest(job_id) == Progress(step=step, time=clock.now)  # reads see the newest
        clock.now += 1
    assert stored_step(store, job_id) == 1  # the first went to etcd, the next four were held
    parts.progress.report(record, Progress(step=6, time=clock.now))
    assert stored_step(store, job_id) == 6  # five seconds on: written


def test_held_progress_needs_no_read_only_within_a_leadership_term(tmp_path: Path) -> None:
    parts, store, clock, job_id = setup(tmp_path)
    record = parts.records.get(job_id)
    assert parts.progress.in_hand(job_id) is None  # nothing reported yet: read etcd
    parts.progress.report(record, Progress(step=1, time=clock.now))
    clock.now += 1
    parts.progress.report(record, Progress(step=2, time=clock.now))  # held, not written
    assert parts.progress.in_hand(job_id) == Progress(step=2, time=clock.now)
    planted = Progress(step=99, time=clock.now + 100)  # what a read would find (none happens)
    store.put(keys.progress(job_id), planted.model_dump_json().encode())
    assert parts.progress.newest(job_id, leading=True) == Progress(step=2, time=clock.now)
    assert parts.progress.newest(job_id) == planted
    parts.records.forget_all()  # leadership changed hands: another leader may have written since
    assert parts.progress.in_hand(job_id) is None
    newer = Progress(step=9, time=clock.now + 5)
    store.put(keys.progress(job_id), newer.model_dump_json().encode())  # the other leader's
    assert parts.progress.newest(job_id) == newer
    parts.progress.report(record, Progress(step=10, time=clock.now + 6))
    assert parts.progress.in_hand(job_id) == Progress(step=10, time=clock.now + 6)


def test_recovering_progress_is_written_at_once_and_finished_jobs_flush(tmp_path: Path) -> None:
    parts, store, clock, job_id = setup(tmp_path)
    record = parts.records.get(job_id)
    parts.progress.report(record, Progress(step=1, time=clock.now))
    clock.now += 1
    recovering = record.model_copy(update={"state": JobState.RECOVERING})
    parts.progress.report(recovering, Progress(step=2, time=clock.now))
    assert stored_step(store, job_id) == 2  # the first step after a resume ends a recovery
    clock.now += 1
    parts.progress.report(record, Progress(step=3, time=clock.now))
    assert stored_step(store, job_id) == 2
    parts.progress.flush(job_id)
    assert stored_step(store, job_id) == 3
    fresh = JobParts.build(store, storage_root=tmp_path, secret=b"k" * 32)  # another instance, or restarted
    assert fresh.progress.newest(job_id) == Progress(step=3, time=clock.now)


def test_a_progress_report_after_the_reformation_ends_a_recovery(tmp_path: Path) -> None:
    parts, _, clock, job_id = setup(tmp_path)
    stored, revision = parts.records.get_versioned(job_id)
    recovering = stored.model_copy(update={"state": JobState.RECOVERING, "state_since": clock.now})
    assert parts.records.write_record(recovering, revision)
    before = Progress(step=4, time=clock.now - 1)  # sent before the group re-formed
    assert parts.records.progress_reported(recovering, before).state == JobState.RECOVERING
    clock.now += 2
    after = parts.records.progress_reported(recovering, Progress(step=5, time=clock.now))
    assert after.state == JobState.RUNNING and parts.records.get(job_id).state == JobState.RUNNING


def test_heartbeats_reach_etcd_at_most_every_write_interval_per_rank(tmp_path: Path) -> None:
    parts, store, clock, job_id = setup(tmp_path)

    def stored(rank: int) -> float | None:
        found = store.get(keys.heartbeat(job_id, "launch-a", rank))
        return json.loads(found.value)["time"] if found else None

    start = clock.now
    for _ in range(3):  # a beat every 5 s from two ranks
        parts.heartbeats.beat(job_id, "launch-a", 0, step=1)
        parts.heartbeats.beat(job_id, "launch-a", 1, step=1)
        clock.now += 5
    assert stored(0) == stored(1) == start  # the beats at +5 s and +10 s were held back
    parts.heartbeats.beat(job_id, "launch-a", 0, step=2)  # at +15 s: due, written
    assert stored(0) == start + 15
    assert stored(1) == start
    parts.heartbeats.beat(job_id, "launch-b", 0, step=0)  # a new launch's first beat goes at once
    assert store.get(keys.heartbeat(job_id, "launch-b", 0)) is not None
    # the reconciler's view: per launch, the oldest of its ranks' newest beats
    assert parts.heartbeats.last_seen(job_id) == {"launch-a": start, "launch-b": start + 15}


def test_many_jobs_read_at_once_see_what_each_read_alone_sees(tmp_path: Path) -> None:
    parts, _, clock, first = setup(tmp_path)
    second = parts.records.create(parse_spec(SPEC))[0].id
    quiet = parts.records.create(parse_spec(SPEC))[0].id  # no progress, no beats
    record = parts.records.get(first)
    parts.progress.report(record, Progress(step=1, time=clock.now))  # written
    clock.now += 1
    parts.progress.report(record, Progress(step=2, time=clock.now))  # held
    parts.progress.report(parts.records.get(second), Progress(step=7, time=clock.now))
    parts.heartbeats.beat(first, "launch-a", 0, step=2)
    parts.heartbeats.beat(first, "launch-a", 1, step=2)
    parts.heartbeats.beat(second, "launch-b", 0, step=7)
    ids = [first, second, quiet]
    assert parts.progress.newest_of(ids) == {job_id: parts.progress.newest(job_id) for job_id in ids}
    assert parts.progress.newest_of(ids)[first] == Progress(step=2, time=clock.now)
    assert parts.progress.newest_of(ids)[quiet] is None
    assert parts.heartbeats.seen_of(ids) == {job_id: parts.heartbeats.seen(job_id) for job_id in ids}
    assert parts.heartbeats.seen_of(ids)[second] == ({"launch-b": clock.now}, {"launch-b": clock.now})
    assert parts.heartbeats.seen_of([first]) == {first: parts.heartbeats.seen(first)}
    assert parts.progress.newest_of([]) == {} and parts.heartbeats.seen_of([]) == {}


def test_a_range_of_many_jobs_reads_what_each_read_alone_sees(tmp_path: Path) -> None:
    parts, _, clock, first = setup(tmp_path)
    ids = [first, *(parts.records.create(parse_spec(SPEC))[0].id for _ in range(11))]
    for n, job_id in enumerate(ids):
        if n % 3:  # some jobs report nothing
            parts.progress.report(parts.records.get(job_id), Progress(step=n, time=clock.now))
    clock.now += 10
    parts.progress.report(parts.records.get(ids[1]), Progress(step=99, time=clock.now))  # held
    some = sorted(ids)[2:10]  # a page in id order, with jobs outside it on both sides
    standby = ProgressBuffer(parts.writes, clock=clock)  # holds nothing: etcd's reports only
    for buffer in (parts.progress, standby):
        for wanted in (ids, some, some[::2] + ids[:1]):
            assert buffer.newest_of(wanted) == {j: buffer.newest(j) for j in wanted}
    assert parts.progress.newest_of(ids)[ids[1]] == Progress(step=99, time=clock.now)
    reported = standby.newest_of(ids)
    assert [n for n, job_id in enumerate(ids) if reported[job_id] is not None] == [1, 2, 4, 5, 7, 8, 10, 11]
