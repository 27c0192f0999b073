"""A rank the workers name as a straggler: the forwarder's report, the job's event, and the
``elastrain report`` section (pure: hand-written events)."""

from __future__ import annotations

from typing import Any

from service.cli.report import render_text
from service.report import Run, build_report
from tests.unit.observability.test_report import ev, progress
from tests.unit.service.jobs.test_incidents import run, running_job, worker
from tests.unit.worker.test_peermode import Client
from worker.report.events import straggler_line
from worker.report.service_client import EventForwarder

NAMED: dict[str, Any] = {
    "rank": 1, "node": 0, "slowdown": 1.84, "first_step": 11, "step": 30, "windows": 2, "threshold": 1.3,
}  # fmt: skip


def test_a_straggler_report_is_one_job_event_that_names_rank_node_slowdown_and_steps() -> None:
    message = straggler_line(NAMED)
    record = run(running_job(), [worker(100.5, "straggler", step=30, message=message)])
    (event,) = [e for e in record.events if e.kind == "straggler"]
    assert event.message == message
    assert "rank 1 on node 0" in message and "1.84x" in message and "steps 11-30" in message
    assert record.state == running_job().state and record.restarts == 0  # nothing else changes


def test_the_report_lists_the_stragglers_the_run_named() -> None:
    events = [ev("run_record", 0.0, world_size=2), progress(1.0, 10), ev("straggler", 2.0, **NAMED)]
    events += [progress(3.0, 40)]
    report = build_report(Run("r", events))
    assert report["stragglers"] == [NAMED]
    text = render_text(report)
    assert "stragglers     1 named" in text and "rank 1 on node 0: 1.84x" in text


def test_a_run_without_stragglers_says_none() -> None:
    report = build_report(Run("r", [ev("run_record", 0.0, world_size=2), progress(1.0, 10)]))
    assert report["stragglers"] == [] and "stragglers     none named" in render_text(report)


def test_rank_0_forwards_a_straggler_to_the_service_and_the_others_do_not() -> None:
    client = Client()
    EventForwarder(client, rank=1, world_size=2, env={})("straggler", dict(NAMED))  # type: ignore[arg-type]
    assert client.sent == []
    EventForwarder(client, rank=0, world_size=2, env={})("straggler", dict(NAMED))  # type: ignore[arg-type]
    assert client.sent == [("straggler", {"rank": 1, "step": 30, "message": straggler_line(NAMED)})]
