"""A run's events kept in its bucket: one object per process, named so they sort by start; the
whole copy is written after a checkpoint and at the end (the end waits for it); a store that
fails is said once and training goes on. The store here is a dict (the S3 side is tested
against SeaweedFS in tests/integration/checkpoint/test_s3_profile.py)."""

from __future__ import annotations

import json
import threading

import pytest

from worker.jobspec.location import S3Location
from worker.report.bucket_events import EVERY_S, BucketEvents, events_object, upload_due
from worker.report.events import Events

JOB = S3Location("ckpt", "runs/a")


def test_objects_sort_by_start_and_stay_under_the_jobs_events_prefix() -> None:
    first = events_object(JOB, 1_700_000_000.5, "node/1 a", 42)
    later = events_object(JOB, 1_700_000_009.0, "b", 7)
    assert str(first) == "s3://ckpt/runs/a/events/1700000000500-node_1_a-42.jsonl"
    assert first.prefix < later.prefix


def test_what_calls_for_a_write() -> None:
    assert upload_due("checkpoint_published", last_write=100.0, now=100.0)
    assert upload_due("finished", last_write=100.0, now=100.0)
    assert not upload_due("progress", last_write=100.0, now=100.0 + EVERY_S - 1)
    assert upload_due("progress", last_write=100.0, now=100.0 + EVERY_S)


def test_the_copy_is_written_whole_and_the_end_waits_for_it(capsys: pytest.CaptureFixture[str]) -> None:
    stored: dict[str, bytes] = {}
    written = threading.Event()

    def write(key: str, data: bytes) -> None:
        stored[key] = data
        written.set()

    events = Events(enabled=True, job="j", rank=0)
    events.copies.append(BucketEvents(events_object(JOB, 1.0, "h", 1), write))
    events.emit("progress", step=1)
    events.emit("checkpoint_published", step=2)
    assert written.wait(10)
    events.emit("progress", step=3)
    events.emit("finished", step=3)  # returns once the write with every line was tried
    (data,) = stored.values()
    assert [json.loads(line)["event"] for line in data.decode().splitlines()] == [
        "progress", "checkpoint_published", "progress", "finished",
    ]  # fmt: skip
    capsys.readouterr()


def test_a_store_that_fails_is_said_once_and_training_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    def write(key: str, data: bytes) -> None:
        raise OSError("store down")

    copy = BucketEvents(events_object(JOB, 1.0, "h", 1), write)
    copy("checkpoint_published", "{}\n")
    copy("finished", "{}\n")  # bounded: the failed write counts as tried
    copy.wait(2, 10)
    err = capsys.readouterr().err
    assert err.count("events not written to s3://ckpt/runs/a/events/") == 1 and "store down" in err
