"""Heartbeats and progress taken on the event loop (the leader writes them behind and holds the
job's record) answer and refuse exactly as those a worker thread takes."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.api.app import create_app
from service.etcd.memory import MemoryStore
from service.jobs.machine import fail
from service.jobs.model import JobRecord, JobState
from service.jobs.parts import JobParts
from service.settings import load_settings
from tests.unit.service.api.test_api import launched
from tests.unit.service.api_client import AUTH, SPEC, TOKEN

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

LATER = 3600.0  # the batch is never written during a test: the beats are held


class Leader:
    def __init__(self, tmp_path: Path) -> None:
        settings = load_settings(data_dir=tmp_path)
        store = MemoryStore()
        self.parts = JobParts.build(
            store, storage_root=settings.checkpoint_root, secret=b"k" * 32, write_behind_s=LATER
        )
        app = create_app(settings, store, api_token=TOKEN, parts=self.parts, leader=lambda: True)
        self.client = TestClient(app, raise_server_exceptions=False)

    def job(self) -> tuple[str, dict[str, str]]:
        job_id = self.client.post("/v1/jobs", json=SPEC, headers=AUTH).json()["id"]
        launched(self.parts.records, job_id)
        token = self.parts.records.worker_token(job_id)
        return job_id, {"Authorization": f"Bearer {token}"}

    def beat(self, job_id: str, worker: dict[str, str], launch: str) -> tuple[int, str]:
        body = {"launch_id": launch, "local_rank": 0, "step": 3}
        answer = self.client.post(f"/v1/jobs/{job_id}/workers/heartbeat", json=body, headers=worker)
        return answer.status_code, answer.text


@pytest.fixture
def leader(tmp_path: Path) -> Iterator[Leader]:
    service = Leader(tmp_path)
    with service.client:
        yield service


def held(leader: Leader, job_id: str) -> JobRecord:
    record = leader.parts.records.cached_recent(job_id)
    assert record is not None and leader.parts.heartbeats.deferred  # the event loop takes the next
    return record


def test_beats_and_progress_on_the_event_loop_are_taken_and_checked(leader: Leader) -> None:
    job_id, worker = leader.job()
    other, others = leader.job()
    launch = f"{job_id}-n0-a0"
    assert leader.beat(job_id, worker, launch)[0] == 200  # a worker thread reads the record
    held(leader, job_id)
    status, text = leader.beat(job_id, worker, launch)
    assert status == 200 and '"cancel_requested":false' in text.replace(" ", "")
    assert launch in leader.parts.heartbeats.seen(job_id)[1]  # held for the next batch
    assert leader.beat(job_id, worker, "made-up")[0] == 422
    assert leader.beat(other, others, f"{other}-n0-a0")[0] == 200
    held(leader, other)
    assert leader.beat(other, worker, f"{other}-n0-a0")[0] == 403  # another job's token
    progress = {"step": 7, "samples_seen": 56, "samples_per_s": 1.0, "loss": 1.0, "world_size": 1}
    url = f"/v1/jobs/{job_id}/workers/progress"
    assert leader.client.post(url, json=progress, headers=worker).status_code == 200
    newest = leader.parts.progress.newest(job_id)
    assert newest is not None and newest.step == 7
    bad = leader.client.post(url, json=progress | {"world_size": 9}, headers=worker)
    assert bad.status_code == 422


def test_a_job_the_leader_holds_is_shown_without_reading_etcd_and_fresh_after_a_write(
    leader: Leader, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id, worker = leader.job()
    leader.beat(job_id, worker, f"{job_id}-n0-a0")
    progress = {"step": 7, "samples_seen": 56, "samples_per_s": 1.0, "loss": 1.0, "world_size": 1}
    assert leader.client.post(f"/v1/jobs/{job_id}/workers/progress", json=progress, headers=worker).is_success
    reads: list[str] = []
    store = leader.parts.records.store
    real_get = store.get
    monkeypatch.setattr(store, "get", lambda key: reads.append(key) or real_get(key))
    shown = leader.client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()
    assert shown["step"] == 7 and shown["samples_seen"] == 56 and not reads
    leader.client.delete(f"/v1/jobs/{job_id}", headers=AUTH)  # a write: the view and record drop
    reads.clear()
    shown = leader.client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()
    assert shown["cancel_requested"] is True and shown["step"] == 7 and reads  # read again
    leader.parts.records.forget_all()  # a new term: held progress may be older than etcd's
    leader.beat(job_id, worker, f"{job_id}-n0-a0")
    leader.parts.views.drop(job_id)
    reads.clear()
    assert leader.client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()["step"] == 7
    assert any("progress" in key for key in reads)


def test_a_job_that_ended_refuses_its_workers_on_the_event_loop_too(leader: Leader) -> None:
    job_id, worker = leader.job()
    leader.beat(job_id, worker, f"{job_id}-n0-a0")
    leader.parts.records.update(job_id, lambda r: fail(r, 1.0, reason="x"))  # drops the held record
    leader.parts.records.get_recent(job_id)
    assert held(leader, job_id).state == JobState.FAILED
    assert leader.beat(job_id, worker, f"{job_id}-n0-a0")[0] == 409


def test_a_callback_in_hand_skips_the_routing_and_answers_exactly_as_the_route(
    leader: Leader, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In hand, a heartbeat or progress report is handled without FastAPI resolving the route's
    dependencies (its token check among them: counted here), with the same answer, headers and
    metrics; a body the route refuses still reaches the route."""
    import service.api.deps as deps

    routed: list[str | None] = []
    real = deps.authorize
    monkeypatch.setattr(
        deps, "authorize", lambda token, **kw: routed.append(kw["job_id"]) or real(token, **kw)
    )
    job_id, worker = leader.job()
    routed.clear()  # the submit's
    url = f"/v1/jobs/{job_id}/workers/heartbeat"
    body = {"launch_id": f"{job_id}-n0-a0", "local_rank": 0, "step": 3}
    first = leader.client.post(url, json=body, headers=worker)  # routed: the record is not held yet
    assert routed == [job_id]
    held(leader, job_id)
    second = leader.client.post(url, json=body, headers=worker)
    assert routed == [job_id]  # not routed
    assert (second.status_code, second.headers, second.content) == (
        first.status_code, first.headers, first.content,
    )  # fmt: skip
    progress = {"step": 7, "samples_seen": 56, "samples_per_s": 1.0, "loss": 1.0, "world_size": 1}
    assert leader.client.post(f"/v1/jobs/{job_id}/workers/progress", json=progress, headers=worker).is_success
    assert routed == [job_id] and leader.parts.progress.newest(job_id).step == 7  # type: ignore[union-attr]
    refused = leader.client.post(url, json={"launch_id": body["launch_id"]}, headers=worker)
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "local_rank"
    assert routed == [job_id, job_id]  # the route said why
    metrics = leader.client.get("/metrics").text
    assert 'route="/v1/jobs/{job_id}/workers/heartbeat",status="200"} 2.0' in metrics
    assert 'route="/v1/jobs/{job_id}/workers/progress",status="200"} 1.0' in metrics
