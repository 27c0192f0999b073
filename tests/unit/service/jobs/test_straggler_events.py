"""A rank the workers name as a straggler: the forwarder's report, the job's event, and the
``elastrain report`` section (pure: hand-written events)."""

from __future__ import annotations

from typing import Any

from service.cli.report import render_text
from service.report import Run, build_report
from tests.unit.observability.test_report import ev, progress
from tests.unit.service.jobs.test_incidents import run, running_job, worker
from tests.unit.worker.test_peermode import Client
from worker.report.events import replace_line, straggler_line
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


REPLACED: dict[str, Any] = {
    "rank": 1, "node": 0, "slowdown": 1.84, "step": 30, "ranks": [1],
    "why": "a warm spare takes its place (1 waiting)",
}  # fmt: skip


def test_a_replacement_is_forwarded_and_becomes_a_job_event_that_changes_nothing_else() -> None:
    client = Client()
    EventForwarder(client, rank=0, world_size=2, env={})("straggler_replaced", dict(REPLACED))  # type: ignore[arg-type]
    message = replace_line(True, REPLACED)
    assert client.sent == [("straggler_replaced", {"rank": 1, "step": 30, "message": message})]
    assert message.startswith(
        "rank 1 on node 0 (1.84x) leaves the group at the next step boundary after step 30"
    )
    record = run(running_job(), [worker(100.5, "straggler_replaced", step=30, message=message)])
    assert [(e.kind, e.message) for e in record.events if e.kind.startswith("straggler")] == [
        ("straggler_replaced", message)
    ]
    assert record.state == running_job().state and record.restarts == 0 and not record.recoveries


def test_a_straggler_kept_says_why_it_was_not_replaced() -> None:
    kept = REPLACED | {
        "why": "no spare waits, and without its 1 rank(s) the group would have 1, below the 2 ..."
    }
    message = replace_line(False, kept)
    assert "is not replaced after step 30: no spare waits" in message
    record = run(running_job(), [worker(100.5, "straggler_kept", step=30, message=message)])
    assert [e.kind for e in record.events if e.kind.startswith("straggler")] == ["straggler_kept"]


def test_the_leaving_rank_says_so_itself_whatever_its_rank() -> None:
    client = Client()
    env = {"ELASTRAIN_LAUNCH_ID": "j-n1-a0"}
    EventForwarder(client, rank=1, world_size=2, env=env)("straggler_left", {"step": 31})  # type: ignore[arg-type]
    ((kind, fields),) = client.sent
    assert kind == "straggler_left" and fields["rank"] == 1 and fields["step"] == 31
    assert fields["message"] == "rank 1 of j-n1-a0 left the group after step 31: its node ends for a spare"
    record = run(running_job(), [worker(100.5, "straggler_left", step=31, message=fields["message"])])
    assert [e.kind for e in record.events if e.kind.startswith("straggler")] == ["straggler_left"]
