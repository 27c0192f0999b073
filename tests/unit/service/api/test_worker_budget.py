"""A worker token cannot fill etcd: unbounded, 30 checkpoint reports of 1 MB with distinct steps
would all be stored, and heartbeats with made-up launch ids on a SUCCEEDED job would create keys
never deleted. Every field is bounded; launch ids, ranks, world
sizes and steps are checked against the job's record; a job's keys are bounded in count; over
its budget a worker gets 429 and a metric names the job; a worker token stops working when the
job ends. (tests/integration/service/test_svc_poison.py measures etcd's size under a flood.)"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.service.api.test_api import launched
from tests.unit.service.api_client import AUTH, TOKEN
from tests.unit.service.api_client import SPEC as BASE_SPEC
from tests.unit.service.svc_fakes import Clock, stage_rank

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from service.api.app import create_app
from service.checkpoints.service import Checkpoints
from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.machine import fail
from service.jobs.parts import JobParts
from service.metrics import Metrics
from service.settings import load_settings
from worker.checkpoint.commit import report_to_json

SPEC = BASE_SPEC | {"max_steps": 1000, "nodes": "1:2"}


class Service:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.store = MemoryStore(clock=self.clock)
        settings = load_settings(data_dir=tmp_path)
        self.parts = JobParts.build(self.store, storage_root=settings.checkpoint_root, secret=b"k" * 32)
        self.parts.budget._clock = self.clock  # the budgets' clock: refills only when a test says
        self.metrics = Metrics()
        checkpoints = Checkpoints.build(self.parts.records, metrics=self.metrics)
        app = create_app(
            settings,
            self.store,
            api_token=TOKEN,
            parts=self.parts,
            checkpoints=checkpoints,
            metrics=self.metrics,
        )
        self.client = TestClient(app, raise_server_exceptions=False)
        job = self.client.post("/v1/jobs", json=SPEC, headers=AUTH).json()
        self.job_id: str = job["id"]
        self.job_dir = Path(job["checkpoint_dir"])
        launched(self.parts.records, self.job_id, nodes=2)
        token = self.parts.records.worker_token(self.job_id)
        self.worker = {"Authorization": f"Bearer {token}"}
        self.base = f"/v1/jobs/{self.job_id}/workers"

    def post(self, path: str, body: Any, **params: Any) -> Any:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = self.worker | {"Content-Type": "application/json"}
        return self.client.post(f"{self.base}/{path}", content=content, headers=headers, params=params)

    def keys_under(self, prefix: str) -> int:
        return len(self.store.list_prefix(prefix, keys_only=True))

    def throttled(self, budget: str) -> float:
        name = "elastrain_api_worker_throttled_total"
        samples = (s for f in self.metrics.registry.collect() for s in f.samples if s.name == name)
        return sum(s.value for s in samples if s.labels == {"job_id": self.job_id, "budget": budget})


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    service = Service(tmp_path)
    with service.client:
        yield service


def report(step: int, **change: Any) -> dict[str, Any]:
    """Rank 0's report as report_to_json writes it (of two ranks: the round stays open)."""
    body = {"step": step, "generation": 0, "rank": 0, "world_size": 2, "ok": True, "error": ""}
    empty = {"files": {}, "pieces": [], "tensors": {}, "meta_digest": "", "rank_meta": {}, "context": {}}
    return body | empty | change


def test_a_report_error_of_a_megabyte_is_refused(svc: Service) -> None:
    resp = svc.post("checkpoints", report(5, error="e" * 1_000_000))
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "error", resp.text
    assert svc.keys_under(keys.reports(svc.job_id)) == 0


def test_reports_for_distinct_steps_open_at_most_four_rounds(svc: Service) -> None:
    """The flood of the issue, with bodies the schema takes: distinct steps each open a save."""
    answers = [svc.post("checkpoints", report(step)).status_code for step in range(1, 31)]
    assert answers == [200] * 4 + [429] * 26
    assert svc.keys_under(keys.reports(svc.job_id)) == 4
    refused = svc.post("checkpoints", report(99))
    assert "at most 4" in refused.json()["error"]["message"] and refused.headers["Retry-After"]
    assert svc.throttled("rounds") == 27


def test_failed_saves_keep_a_bounded_number_of_outcomes(svc: Service) -> None:
    for step in range(1, 41):
        assert (
            svc.post("checkpoints", report(step, ok=False, error="disk full")).json()["status"] == "aborted"
        )
    assert svc.keys_under(keys.outcomes(svc.job_id)) == 16
    assert svc.keys_under(keys.reports(svc.job_id)) == 0


def test_a_publish_collects_the_rounds_that_can_no_longer_publish(svc: Service) -> None:
    for step in (1, 2, 3):
        assert svc.post("checkpoints", report(step)).status_code == 200
    for rank in (0, 1):  # a complete round at step 8 publishes
        staged = stage_rank(svc.job_dir, job=svc.job_id, step=8, generation=0, rank=rank, world_size=2)
        assert svc.post("checkpoints", report_to_json(staged).encode()).json()["status"] in (
            "pending",
            "published",
        )
    assert svc.post("checkpoints", report(9)).status_code == 200
    assert svc.keys_under(keys.reports(svc.job_id)) == 1  # steps 1-3 dropped: older than 8
    old = svc.post("checkpoints", report(2))
    assert old.json()["status"] == "aborted" and svc.keys_under(keys.outcomes(svc.job_id)) == 1


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"world_size": 3}, "world_size"),  # nodes 1:2, one process each: 1 or 2
        ({"world_size": 99_999, "rank": 7}, "world_size"),
        ({"step": 1001}, "step"),  # beyond max_steps
        ({"generation": 1 << 63}, "generation"),
    ],
)
def test_reports_are_checked_against_the_job(svc: Service, change: dict[str, Any], field: str) -> None:
    resp = svc.post("checkpoints", report(5) | change)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text


def test_heartbeats_name_a_node_of_the_job(svc: Service) -> None:
    for launch_id in ("made-up", f"{svc.job_id}-n7-a0", "other-job-n0-a0"):
        resp = svc.post("heartbeat", {"launch_id": launch_id, "local_rank": 0})
        assert resp.status_code == 422 and resp.json()["error"]["field"] == "launch_id", resp.text
    resp = svc.post("heartbeat", {"launch_id": f"{svc.job_id}-n0-a0", "local_rank": 1})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "local_rank"
    assert svc.keys_under(keys.heartbeats(svc.job_id)) == 0
    assert svc.post("heartbeat", {"launch_id": f"{svc.job_id}-n1-a0", "local_rank": 0}).status_code == 200
    assert svc.keys_under(keys.heartbeats(svc.job_id)) == 1


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("progress", {"step": 1, "world_size": 3}, "world_size"),
        ("events", {"kind": "group_formed", "world_size": 5}, "world_size"),
        ("events", {"kind": "log", "rank": 2}, "rank"),
        ("events", {"kind": "log", "node_index": 2}, "node_index"),
        ("progress", {"step": 1 << 63}, "step"),
    ],
)
def test_progress_and_events_are_checked_against_the_job(
    svc: Service, path: str, body: dict[str, Any], field: str
) -> None:
    resp = svc.post(path, body)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == field, resp.text


def test_a_flood_of_callbacks_gets_429_and_the_metric_names_the_job(svc: Service) -> None:
    beat = {"launch_id": f"{svc.job_id}-n0-a0", "local_rank": 0}
    answers = [svc.post("heartbeat", beat).status_code for _ in range(300)]
    burst = 256 + 8 * 2
    assert answers[:burst] == [200] * burst and set(answers[burst:]) == {429}
    assert svc.throttled("requests") == 300 - burst
    svc.clock.advance(1.0)  # 16 + 2 W requests a second come back
    assert [svc.post("heartbeat", beat).status_code for _ in range(21)] == [200] * 20 + [429]


def test_bytes_over_the_budget_get_429(svc: Service) -> None:
    big = report(5, rank_meta={"pad": "x" * 900_000})  # under the 1 MiB body limit
    size = len(json.dumps(big).encode())
    fits = (16 + 2) * (1 << 20) // size  # a burst of 16 MiB + 1 MiB x W
    answers = [svc.post("checkpoints", big).status_code for _ in range(fits + 3)]
    assert answers == [200] * fits + [429] * 3
    assert svc.throttled("bytes") == 3


def test_a_worker_token_stops_working_when_the_job_ends(svc: Service) -> None:
    svc.parts.records.update(svc.job_id, lambda r: fail(r, svc.clock(), reason="test"))
    beat = {"launch_id": f"{svc.job_id}-n0-a0", "local_rank": 0}
    for path, body in [("heartbeat", beat), ("progress", {"step": 3}), ("events", {"kind": "log"}),
                       ("checkpoints", report(5))]:  # fmt: skip
        resp = svc.post(path, body)
        assert resp.status_code == 409 and resp.json()["error"]["code"] == "job_finished", (path, resp.text)
        assert "no longer work" in resp.json()["error"]["message"]
    resume = f"/v1/jobs/{svc.job_id}/resume"
    assert svc.client.get(resume, headers=svc.worker).status_code == 409
    assert svc.client.get(resume, headers=AUTH).status_code == 200  # the operator still reads
    assert svc.client.post(f"{svc.base}/heartbeat", json=beat, headers=AUTH).status_code == 409
    assert svc.keys_under(keys.heartbeats(svc.job_id)) == 0
