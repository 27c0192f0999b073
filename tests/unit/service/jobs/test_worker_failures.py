"""A deterministic worker error fails the job with its line instead of spending the restarts:
the same line at the same step from two attempts in a row (pure state machine, plain values)."""

from __future__ import annotations

from service.jobs.events import WorkerEvent, apply_worker_event, recorded_failures
from service.jobs.machine import Cancel, Observation, reconcile
from service.jobs.model import JobRecord, JobState, NodePhase
from tests.unit.service.jobs.test_job_machine import job, launched, running

S = JobState
LINE = "error: field 'model.output': 'auto' cannot pick from what the forward returned, dict with keys ['x']"


def failed(rank: int, attempt: str, line: str = LINE, step: int | None = None) -> WorkerEvent:
    return WorkerEvent(kind="failed", rank=rank, step=step, group_id=attempt, message=line)


def feed(record: JobRecord, *events: WorkerEvent, now: float = 5.0) -> JobRecord:
    for i, event in enumerate(events):
        record = apply_worker_event(record, event, now + i)
    return record


def test_the_same_error_in_the_next_attempt_fails_the_job_with_that_line() -> None:
    record = launched(job(restarts=3))
    record = feed(record, failed(0, "n0-restart-0"), failed(1, "n0-restart-0"))
    assert record.state == S.RUNNING, "one attempt's error is not yet known to repeat"
    assert len(recorded_failures(record)) == 1, "the second rank of the same attempt is recorded once"
    record = feed(record, failed(1, "n0-restart-1"), now=9.0)
    assert record.state == S.FAILED and record.restarts == 0
    assert record.reason is not None and record.reason.endswith(LINE)
    assert "at start-up in two attempts in a row" in record.reason
    assert all(n.phase == NodePhase.STOPPING for n in record.nodes)
    decision = reconcile(record, Observation(now=10.0, statuses=running(launched(job(restarts=3)))))
    assert {a.node.launch_id for a in decision.actions if isinstance(a, Cancel)} == {"j-1-n0-a0", "j-1-n1-a0"}


def test_the_same_error_at_the_same_step_during_training_fails_it_too() -> None:
    line = "AttributeError: 'Out' object has no attribute 'float'"
    record = feed(
        launched(job()), failed(0, "generation-1", line, step=7), failed(0, "generation-2", line, step=7)
    )
    assert record.state == S.FAILED and "at step 7" in (record.reason or "")


def test_another_step_or_another_line_is_a_new_failure_that_restarts() -> None:
    line = "RuntimeError: boom"
    record = feed(
        launched(job()), failed(0, "generation-1", line, step=7), failed(0, "generation-2", line, step=9)
    )
    assert record.state == S.RUNNING
    record = feed(record, failed(0, "generation-3", "RuntimeError: other", step=9), now=20.0)
    assert record.state == S.RUNNING
    assert len(recorded_failures(record)) == 3


def test_the_peers_own_errors_do_not_hide_the_repeat() -> None:
    """Rank 0 hits the bug; rank 1 fails on the broken connection, with a port in its line."""
    bug = "ValueError: bad sample 17"
    record = feed(
        launched(job()),
        failed(0, "generation-1", bug, step=3),
        failed(1, "generation-1", "Connection closed by peer [127.0.0.1]:4711", step=3),
        failed(1, "generation-2", "Connection closed by peer [127.0.0.1]:5120", step=3),
    )
    assert record.state == S.RUNNING
    record = feed(record, failed(0, "generation-2", bug, step=3), now=30.0)
    assert record.state == S.FAILED and (record.reason or "").endswith(bug)


def test_not_consecutive_attempts_do_not_count() -> None:
    line = "RuntimeError: boom"
    record = feed(
        launched(job()),
        failed(0, "generation-1", line, step=4),
        failed(0, "generation-2", "RuntimeError: else", step=4),
        failed(0, "generation-3", line, step=4),
    )
    assert record.state == S.RUNNING


def test_a_report_without_an_attempt_never_fails_the_job_by_itself() -> None:
    plain = WorkerEvent(kind="failed", rank=0, message=LINE)
    record = feed(launched(job()), plain, plain.model_copy(update={"rank": 1}))
    assert record.state == S.RUNNING


def test_a_finished_job_ignores_failures() -> None:
    done = launched(job()).model_copy(update={"state": S.SUCCEEDED})
    assert feed(done, failed(0, "a"), failed(0, "b")) == done


def test_a_rank_that_says_a_restart_cannot_help_fails_the_job_at_once() -> None:
    line = (
        "error: the final checkpoint (step 30) could not be published in /ck: publishing failed: "
        "[Errno 28] No space left on device; the newest published checkpoint is step 10"
    )
    event = WorkerEvent(
        kind="failed", rank=0, step=30, group_id="generation-1", message=line, restartable=False
    )
    record = feed(launched(job(restarts=3)), event)
    assert record.state == S.FAILED and record.restarts == 0
    assert record.reason is not None and record.reason.endswith(line) and "rank 0 at step 30" in record.reason
    assert all(n.phase == NodePhase.STOPPING for n in record.nodes)
