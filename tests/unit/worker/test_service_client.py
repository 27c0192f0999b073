"""The worker's service client posts lifecycle events at once but coalesces progress: the
trainer reports every ``log_every_steps`` (many times a second on a small model), the service
gets the newest numbers every ``progress_s`` and once more at close. HTTP goes to httpx's
in-memory MockTransport (no socket); the client's own thread runs for real."""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx

from worker.checkpoint.commit import Report
from worker.jobspec.jsonlimits import finite, loads
from worker.report.service_client import (
    PERIOD_RANGE_S,
    HttpCoordinator,
    ServiceClient,
    ServiceConfig,
    _period,
)

CFG = ServiceConfig(url="http://svc", token="t", job_id="job-1", launch_id="job-1-n0", node_index=0)


class Recorder:
    def __init__(self) -> None:
        self.posts: list[tuple[str, dict[str, object]]] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.posts.append((request.url.path, json.loads(request.content)))
        return httpx.Response(200, json={"cancel_requested": False})


def test_progress_is_coalesced_to_the_newest_and_events_go_at_once() -> None:
    seen = Recorder()
    # Intervals far beyond the test: nothing is due on the timer, so what is posted is exactly
    # what must be posted regardless of timing (events, then the held progress at close).
    client = ServiceClient(CFG, heartbeat_s=3600, progress_s=3600, transport=httpx.MockTransport(seen))
    client.event("first_step", rank=0, step=1)
    for step in range(1, 51):
        client.progress(step=step, samples_seen=step * 8, samples_per_s=100.0, loss=0.5, world_size=2)
    client.event("finished", rank=0, step=50, message="done")
    client.close()
    paths = [path for path, _ in seen.posts]
    assert paths == [
        "/v1/jobs/job-1/workers/events",
        "/v1/jobs/job-1/workers/events",
        "/v1/jobs/job-1/workers/progress",
    ]
    assert seen.posts[-1][1] == {
        "step": 50, "samples_seen": 400, "samples_per_s": 100.0, "loss": 0.5, "world_size": 2,
    }  # fmt: skip


def test_held_progress_goes_out_when_due() -> None:
    seen = Recorder()
    posted = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        answer = seen(request)
        if request.url.path.endswith("/progress"):
            posted.set()
        return answer

    client = ServiceClient(CFG, heartbeat_s=3600, progress_s=0.05, transport=httpx.MockTransport(handler))
    try:
        client.progress(step=7, samples_seen=56, samples_per_s=10.0, loss=None, world_size=1)
        assert posted.wait(timeout=30)  # a hang fails here; how soon is not asserted
    finally:
        client.close()
    assert seen.posts[0] == (
        "/v1/jobs/job-1/workers/progress",
        {"step": 7, "samples_seen": 56, "samples_per_s": 10.0, "loss": None, "world_size": 1},
    )


def test_an_event_is_retried_through_a_failover_and_a_rejected_one_is_not() -> None:
    answers = {"first_step": [503, 503, 200], "finished": [422]}
    seen = Recorder()

    def handler(request: httpx.Request) -> httpx.Response:
        seen(request)
        status = answers[json.loads(request.content)["kind"]].pop(0)
        return httpx.Response(status, json={"error": "not the leader"} if status != 200 else {})

    client = ServiceClient(
        CFG, heartbeat_s=3600, progress_s=3600, event_retry_s=(0.01, 0.01, 0.01),
        transport=httpx.MockTransport(handler),
    )  # fmt: skip
    client.event("first_step", rank=0, step=1)  # a standby answers 503 twice, then the new leader
    client.event("finished", rank=0, step=1, message="done")  # 422: a bad request is not repeated
    client.close()
    kinds = [body["kind"] for _, body in seen.posts]
    assert kinds == ["first_step", "first_step", "first_step", "finished"]
    assert answers == {"first_step": [], "finished": []}
    assert client.dropped == 0


def test_an_event_is_dropped_and_counted_after_the_last_retry() -> None:
    seen = Recorder()

    def handler(request: httpx.Request) -> httpx.Response:
        seen(request)
        return httpx.Response(503, json={"error": "not the leader"})

    client = ServiceClient(
        CFG, heartbeat_s=3600, progress_s=3600, event_retry_s=(0.01, 0.01),
        transport=httpx.MockTransport(handler),
    )  # fmt: skip
    client.event("first_step", rank=0, step=1)
    client.close()
    assert len(seen.posts) == 3  # the first attempt and two retries
    assert client.dropped == 1


def test_a_rank_that_stops_says_why_where_and_in_which_attempt() -> None:
    """What the service needs to tell a deterministic error (same line, same step, next attempt)
    from a one-off; the body is a valid WorkerEvent."""
    from service.jobs.events import WorkerEvent
    from worker.report.service_client import attempt_id

    seen = Recorder()
    client = ServiceClient(CFG, heartbeat_s=3600, progress_s=3600, transport=httpx.MockTransport(seen))
    client.failed(
        "AttributeError: 'Out' object has no attribute 'float'\n", rank=1, step=7, attempt="generation-5"
    )
    client.close()
    path, body = seen.posts[0]
    assert path == "/v1/jobs/job-1/workers/events"
    event = WorkerEvent.model_validate(body)
    assert (event.kind, event.rank, event.step, event.group_id) == ("failed", 1, 7, "generation-5")
    assert event.message == "AttributeError: 'Out' object has no attribute 'float'"
    assert attempt_id({}, 17) == "generation-17"
    before = {"ELASTRAIN_LAUNCH_ID": "j-n0-a0", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert attempt_id(before, None) == "j-n0-a0-restart-2"


def test_a_diverged_loss_reaches_the_service_as_null_not_nan() -> None:
    """The service refuses NaN and Infinity in any body (they are not JSON): a run whose loss
    diverged still reports its progress, with the loss as null."""
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(200, json={"cancel_requested": False})

    client = ServiceClient(CFG, heartbeat_s=3600, progress_s=3600, transport=httpx.MockTransport(handler))
    client.progress(step=3, samples_seen=24, samples_per_s=float("inf"), loss=float("nan"), world_size=2)
    client.close()
    sent = loads(bodies[-1], max_bytes=1 << 20, max_depth=8, what="progress", reject_non_finite=True)
    assert sent["loss"] is None and sent["step"] == 3


def test_a_report_the_service_throttles_is_sent_again_after_its_retry_after() -> None:
    answers = iter(
        [httpx.Response(429, headers={"Retry-After": "0.01"}, json={}), httpx.Response(200, json={})]
    )
    posted: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        posted.append(request.content)
        return next(answers)

    client = ServiceClient(CFG, heartbeat_s=3600, progress_s=3600, transport=httpx.MockTransport(handler))
    report = Report(step=4, generation=7, rank=0, world_size=2, ok=False, error="x")
    report = dataclasses.replace(report, context={"metrics": {"loss": float("nan")}})
    HttpCoordinator(client, retry_s=0.01).report(report, seq=1)
    client.close()
    assert len(posted) == 2 and posted[0] == posted[1]
    body = loads(posted[-1], max_bytes=1 << 20, max_depth=16, what="report", reject_non_finite=True)
    assert body["context"]["metrics"]["loss"] is None


def test_finite_replaces_only_non_finite_numbers() -> None:
    value = {"a": [1.0, float("nan"), (float("-inf"), 2)], "b": {"c": float("inf"), "d": "x"}, "e": 3}
    assert finite(value) == {"a": [1.0, None, [None, 2]], "b": {"c": None, "d": "x"}, "e": 3}


def outcome_client(statuses: list[str]) -> tuple[ServiceClient, list[str]]:
    """A client whose service answers the outcome polls with ``statuses`` in turn (then the last)."""
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        status = statuses[min(len(asked), len(statuses) - 1)]
        asked.append(status)
        return httpx.Response(200, json={"status": status, "reason": f"service says {status}"})

    return ServiceClient(
        CFG, heartbeat_s=3600, progress_s=3600, transport=httpx.MockTransport(handler)
    ), asked


def test_a_save_stops_waiting_when_the_group_lost_a_member() -> None:
    """Peer mode: a member is gone, so the round cannot complete before the group re-forms; the
    wait ends as an abort with that reason at the next look, not at the timeout."""
    client, asked = outcome_client(["pending"])
    lost: list[str | None] = [None, None, "the group lost member ab12cd34: the save cannot complete"]
    coordinator = HttpCoordinator(
        client, retry_s=0.01, abandon=lambda: lost.pop(0) if len(lost) > 1 else lost[0]
    )
    outcome = coordinator.outcome(20, 3, seq=1, timeout=600.0)
    client.close()
    assert not outcome.published and outcome.reason.startswith("the group lost member ab12cd34")
    assert asked and set(asked) == {"pending"}


def test_the_services_answer_wins_over_a_loss_seen_after_it() -> None:
    """A member that saw "published" finished and went before this rank's next poll: its end is
    no reason to call a published save aborted."""
    client, _ = outcome_client(["pending", "published"])
    coordinator = HttpCoordinator(client, retry_s=0.01, abandon=lambda: "the group lost member x")
    outcome = coordinator.outcome(20, 3, seq=1, timeout=600.0)
    client.close()
    assert outcome.published and outcome.reason == "service says published"


def test_heartbeats_and_progress_follow_the_periods_the_service_asks_for() -> None:
    beats: list[float] = []
    third = threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/heartbeat"):
            beats.append(1.0)
            if len(beats) >= 3:
                third.set()
        return httpx.Response(200, json={"cancel_requested": False, "heartbeat_s": 0.05, "progress_s": 0.05})

    # An hour between beats unless the service asks otherwise: the first beat's answer does.
    client = ServiceClient(CFG, heartbeat_s=3600, progress_s=0.05, transport=httpx.MockTransport(handler))
    try:
        client.heartbeat_from(0)
        assert third.wait(timeout=30)
    finally:
        client.close()


def test_a_period_the_service_asks_for_is_bounded_and_nonsense_is_ignored() -> None:
    assert _period(20.0, 5.0) == 20.0
    assert _period(0, 5.0) == PERIOD_RANGE_S[0]
    assert _period(1e9, 5.0) == PERIOD_RANGE_S[1]
    for nonsense in (None, "20", True, float("nan"), [20]):
        assert _period(nonsense, 5.0) == 5.0
