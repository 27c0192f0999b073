"""The REST API in process (no sockets): every bad input is a 4xx with a message, never a 500."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.service.api_client import AUTH, TOKEN, api
from tests.unit.service.api_client import SPEC as BASE_SPEC

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from service.api.app import create_app
from service.checkpoints.service import Checkpoints
from service.etcd.memory import MemoryStore
from service.jobs.model import JobRecord, JobState, NodePhase, NodeRecord
from service.jobs.parts import JobParts
from service.jobs.service import JobService
from service.metrics import Metrics
from service.settings import load_settings
from tests.unit.service.svc_fakes import stage_rank
from worker.checkpoint.commit import report_to_json

SPEC = BASE_SPEC | {"nodes": "1:3", "optimizer": {"betas": [0.9, 0.99]}}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with api(tmp_path, max_body_bytes=64 * 1024) as c:
        yield c


def submit(client: TestClient, spec: dict[str, Any] | None = None, **headers: str) -> Any:
    resp = client.post("/v1/jobs", json=spec or SPEC, headers=AUTH | headers)
    assert resp.status_code in (200, 201), resp.text
    return resp.json()


def launched(jobs: JobService, job_id: str, nodes: int = 1) -> JobRecord:
    """The job as the reconciler leaves it after launching ``nodes`` nodes (what a heartbeat's
    launch id must name)."""

    def launch(record: JobRecord) -> JobRecord:
        running = tuple(
            NodeRecord(index=i, launch_id=f"{job_id}-n{i}-a0", phase=NodePhase.RUNNING, handle=f"h{i}")
            for i in range(nodes)
        )
        return record.model_copy(update={"nodes": running, "state": JobState.RUNNING})

    return jobs.update(job_id, launch)


def error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body: dict[str, Any] = resp.json()["error"]
    assert body["message"] and body["code"]
    return body


def test_submit_get_list_scale_cancel(client: TestClient) -> None:
    job = submit(client)
    assert job["state"] == "PENDING" and job["desired_nodes"] == 3 and job["nodes_range"] == "1:3"
    assert job["checkpoint_dir"].endswith(f"/checkpoints/{job['id']}")
    assert job["spec"]["checkpoint"]["dir"] == job["checkpoint_dir"]
    assert job["spec"]["checkpoint"]["async"] is False  # the spec as JSON, with its aliases
    assert job["spec"]["optimizer"]["betas"] == [0.9, 0.99]
    got = client.get(f"/v1/jobs/{job['id']}", headers=AUTH).json()
    assert got["id"] == job["id"] and got["events"][0]["kind"] == "submitted"
    listed = client.get("/v1/jobs", headers=AUTH).json()
    assert [j["id"] for j in listed["jobs"]] == [job["id"]]
    scaled = client.post(f"/v1/jobs/{job['id']}/scale", json={"nodes": 2}, headers=AUTH)
    assert scaled.status_code == 202 and scaled.json()["desired_nodes"] == 2
    first = client.delete(f"/v1/jobs/{job['id']}", headers=AUTH)
    again = client.delete(f"/v1/jobs/{job['id']}", headers=AUTH)
    assert first.status_code == again.status_code == 202
    assert first.json()["cancel_requested"] and again.json() == first.json()


def test_idempotency_key_returns_the_same_job(client: TestClient) -> None:
    first = client.post("/v1/jobs", json=SPEC, headers=AUTH | {"Idempotency-Key": "k"})
    second = client.post("/v1/jobs", json=SPEC, headers=AUTH | {"Idempotency-Key": "k"})
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    other = client.post("/v1/jobs", json=SPEC | {"max_steps": 5}, headers=AUTH | {"Idempotency-Key": "k"})
    assert "different spec" in error(other, 409)["message"]
    assert len(client.get("/v1/jobs", headers=AUTH).json()["jobs"]) == 1


def test_list_is_paginated_and_filtered(client: TestClient) -> None:
    ids = sorted(submit(client)["id"] for _ in range(5))
    page = client.get("/v1/jobs?limit=2", headers=AUTH).json()
    seen = [j["id"] for j in page["jobs"]]
    while page["next_cursor"]:
        page = client.get(f"/v1/jobs?limit=2&cursor={page['next_cursor']}", headers=AUTH).json()
        seen += [j["id"] for j in page["jobs"]]
    assert seen == ids
    assert client.get("/v1/jobs?state=RUNNING", headers=AUTH).json()["jobs"] == []
    assert error(client.get("/v1/jobs?state=BOGUS", headers=AUTH), 422)["field"] == "state"


@pytest.mark.parametrize("state", ["", "&state=PENDING"])
def test_a_last_page_that_is_exactly_full_has_no_cursor(client: TestClient, state: str) -> None:
    ids = sorted(submit(client)["id"] for _ in range(4))
    first = client.get(f"/v1/jobs?limit=2{state}", headers=AUTH).json()
    second = client.get(f"/v1/jobs?limit=2&cursor={first['next_cursor']}{state}", headers=AUTH).json()
    assert [j["id"] for j in first["jobs"] + second["jobs"]] == ids
    assert second["next_cursor"] is None


@pytest.mark.parametrize(
    ("body", "status", "field", "fix"),
    [
        (b"{not json", 400, None, "send a JobSpec"),
        (b"[1, 2]", 422, "body", "one JSON object"),
        (b'{"name": "x"}', 422, "model", "add it"),
        (None, 422, "max_steps", "give a whole number without quotes"),
    ],
)
def test_bad_spec_bodies(
    client: TestClient, body: bytes | None, status: int, field: str | None, fix: str
) -> None:
    content = (
        body
        if body is not None
        else b'{"name":"x","model":{"name":"mlp"},"data":{"name":"synthetic"},'
        b'"micro_batch_size":1,"max_steps":"10"}'
    )
    err = error(client.post("/v1/jobs", content=content, headers=AUTH), status)
    assert err["field"] == field and fix in err["message"], err


@pytest.mark.parametrize(
    ("change", "field", "fix"),
    [
        ({"unknown": 1}, "unknown", "remove it"),
        ({"micro_batch_size": "8"}, "micro_batch_size", "give a whole number without quotes"),
        ({"nodes": "3:1"}, "nodes", "must be N or MIN:MAX with 1 <= MIN <= MAX"),
        ({"checkpoint": {"dir": "../../etc"}}, "checkpoint.dir", "without '..'"),
        ({"checkpoint": {"dir": "/etc/cron.d"}}, "checkpoint.dir", "give a relative directory name"),
        ({"checkpoint": {"dir": "a\u0000b"}}, "checkpoint.dir", "give a plain path"),
        ({"checkpoint": {"resume": "/etc/passwd"}}, "checkpoint.resume", "give a relative directory name"),
        ({"model": {"factory": "os:system; rm"}}, "model.factory", "of the form 'package.module:function'"),
    ],
)
def test_invalid_fields_are_422_naming_the_field_and_the_fix(
    client: TestClient, change: dict[str, Any], field: str, fix: str
) -> None:
    err = error(client.post("/v1/jobs", json=SPEC | change, headers=AUTH), 422)
    assert err["field"] == field and f"field '{field}'" in err["message"], err
    assert fix in err["message"], err


def test_oversize_body_is_413_before_parsing(client: TestClient) -> None:
    err = error(client.post("/v1/jobs", content=b"{" + b" " * 70_000, headers=AUTH), 413)
    assert "ELASTRAIN_MAX_BODY_BYTES" in err["message"]


def test_tokens(client: TestClient) -> None:
    job = submit(client)
    assert error(client.get("/v1/jobs"), 401)["code"] == "unauthenticated"
    assert error(client.get("/v1/jobs", headers={"Authorization": "Bearer wrong"}), 401)
    assert client.get("/healthz").status_code == 200  # no token needed
    ctx = client.app.state.ctx  # type: ignore[attr-defined]
    mine, other_job = ctx.jobs.worker_token(job["id"]), submit(client)
    worker = {"Authorization": f"Bearer {mine}"}
    launched(ctx.jobs, job["id"])  # a heartbeat names one of the job's nodes
    beat = {"launch_id": f"{job['id']}-n0-a0", "local_rank": 0, "step": 3}
    assert (
        client.post(f"/v1/jobs/{job['id']}/workers/heartbeat", json=beat, headers=worker).status_code == 200
    )
    assert error(client.post(f"/v1/jobs/{other_job['id']}/workers/heartbeat", json=beat, headers=worker), 403)
    assert error(client.get("/v1/jobs", headers=worker), 403)
    assert error(client.get(f"/v1/jobs/{job['id']}", headers=worker), 403)


def test_unknown_job_is_404_everywhere(client: TestClient) -> None:
    for method, path, body in [
        ("GET", "/v1/jobs/nope", None),
        ("GET", "/v1/jobs/..%2F..%2Fetc", None),
        ("POST", "/v1/jobs/nope/scale", {"nodes": 1}),
        ("DELETE", "/v1/jobs/nope", None),
        ("GET", "/v1/jobs/nope/checkpoints", None),
        ("GET", "/v1/jobs/nope/resume", None),
        ("POST", "/v1/jobs/nope/workers/progress", {"step": 1}),
    ]:
        resp = client.request(method, path, json=body, headers=AUTH)
        assert resp.status_code == 404, (method, path, resp.text)


def test_scale_errors(client: TestClient) -> None:
    job = submit(client)
    url = f"/v1/jobs/{job['id']}/scale"
    assert error(client.post(url, json={"nodes": 4}, headers=AUTH), 422)["field"] == "nodes"
    assert error(client.post(url, json={"nodes": "2"}, headers=AUTH), 422)["field"] == "nodes"
    assert error(client.post(url, json={"nodes": 2, "x": 1}, headers=AUTH), 422)["field"] == "x"
    json_type = {"Content-Type": "application/json"}
    assert error(client.post(url, content=b"{", headers=AUTH | json_type), 400)["code"] == "malformed_json"
    assert "Content-Type" in error(client.post(url, content=b"nodes=2", headers=AUTH), 422)["message"]
    client.delete(f"/v1/jobs/{job['id']}", headers=AUTH)
    assert error(client.post(url, json={"nodes": 2}, headers=AUTH), 409)["code"] == "job_finished"


def test_worker_progress_and_events_show_in_status(client: TestClient) -> None:
    job = submit(client)
    base = f"/v1/jobs/{job['id']}/workers"
    progress = {"step": 7, "samples_per_s": 123.5, "loss": 0.25, "world_size": 2}
    assert client.post(f"{base}/progress", json=progress, headers=AUTH).status_code == 200
    event = {"kind": "group_formed", "group_id": "g", "world_size": 2, "rank": 0}
    assert client.post(f"{base}/events", json=event, headers=AUTH).json()["state"] == "PENDING"
    got = client.get(f"/v1/jobs/{job['id']}", headers=AUTH).json()
    assert (got["step"], got["samples_per_s"], got["loss"], got["world_size"]) == (7, 123.5, 0.25, 2)
    assert error(client.post(f"{base}/events", json={"kind": "boom"}, headers=AUTH), 422)["field"] == "kind"
    metrics = client.get("/metrics").text
    assert f'elastrain_job_step{{job_id="{job["id"]}"}} 7.0' in metrics


def test_status_shows_the_world_size_that_trained_the_newest_step(client: TestClient) -> None:
    """After a scale-down the group re-forms smaller, and its progress comes from the smaller group:
    GET (the job and the job list) says so with the step it reports, not from the record the
    reconciler rewrites at its next pass (a 2 -> 3 -> 1 scale test once waited on that pass past
    the job's end)."""
    job = submit(client)
    ctx = client.app.state.ctx  # type: ignore[attr-defined]
    launched(ctx.jobs, job["id"], nodes=3)
    base = f"/v1/jobs/{job['id']}/workers"
    event = {"kind": "group_formed", "group_id": "g", "world_size": 3, "rank": 0}
    assert client.post(f"{base}/events", json=event, headers=AUTH).status_code == 200
    progress = {"step": 12, "samples_per_s": 10.0, "loss": 0.5, "world_size": 1}
    assert client.post(f"{base}/progress", json=progress, headers=AUTH).status_code == 200
    got = client.get(f"/v1/jobs/{job['id']}", headers=AUTH).json()
    assert (got["state"], got["step"], got["world_size"]) == ("RUNNING", 12, 1)
    # The job list says the same (it showed the record's 3 until the reconciler's next pass)
    listed = {j["id"]: j for j in client.get("/v1/jobs", headers=AUTH).json()["jobs"]}
    assert listed[job["id"]]["world_size"] == 1
    assert ctx.jobs.get(job["id"]).world_size == 3, "the stored record waits for the reconciler"


def test_openapi_documents_the_spec_body(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/JobSpec"}
    assert "ModelSpec" in schema["components"]["schemas"]


def test_checkpoint_reports_publish_and_show_in_checkpoints_and_resume(tmp_path: Path) -> None:
    settings = load_settings(data_dir=tmp_path)
    store = MemoryStore()
    parts = JobParts.build(store, storage_root=settings.checkpoint_root, secret=b"k" * 32)
    jobs = parts.records
    checkpoints = Checkpoints.build(jobs, metrics=Metrics())
    app = create_app(
        settings, store, api_token=TOKEN, parts=parts, checkpoints=checkpoints, metrics=Metrics()
    )
    with TestClient(app, raise_server_exceptions=False) as client:
        job = submit(client, SPEC | {"nodes": "2"})
        worker = {"Authorization": f"Bearer {jobs.worker_token(job['id'])}"}
        base = f"/v1/jobs/{job['id']}"
        job_dir = Path(job["checkpoint_dir"])
        outcomes = []
        for rank in (0, 1):
            report = stage_rank(job_dir, job=job["id"], step=8, generation=0, rank=rank, world_size=2)
            resp = client.post(f"{base}/workers/checkpoints", content=report_to_json(report), headers=worker)
            assert resp.status_code == 200, resp.text
            outcomes.append(resp.json()["status"])
        assert outcomes == ["pending", "published"]
        assert client.get(f"{base}/workers/checkpoints/8?generation=0", headers=worker).json()["published"]
        listed = client.get(f"{base}/checkpoints", headers=AUTH).json()["checkpoints"]
        assert [(c["step"], c["world_size"], c["verified"]) for c in listed] == [(8, 2, True)]
        resume = client.get(f"{base}/resume?world_size=3", headers=worker).json()
        assert resume["checkpoint"]["step"] == 8 and sorted(resume["load_plan"]) == ["0", "1", "2"]
        assert client.get(base, headers=AUTH).json()["last_published_step"] == 8
        assert error(client.get(f"{base}/resume?world_size=0", headers=worker), 422)["field"] == "world_size"


@pytest.mark.parametrize("raw", ["%2B0.0", "1_0", "%207", "0x10", "1e3"])
def test_integer_parameters_take_decimal_digits_only(client: TestClient, raw: str) -> None:
    """Found by schemathesis (negative, seed 2101011686): '+0.0' was taken as step 0."""
    job = submit(client)
    body = error(client.get(f"/v1/jobs/{job['id']}/workers/checkpoints/{raw}", headers=AUTH), 422)
    assert "whole number" in body["message"] and body["field"] == "step"
    body = error(client.get(f"/v1/jobs?limit={raw}", headers=AUTH), 422)
    assert "decimal digits" in body["message"] and body["field"] == "limit"


def test_a_report_whose_metrics_are_not_numbers_is_refused(client: TestClient) -> None:
    """Found by schemathesis (negative, seed 2101011686): ``true`` passed as a metric value."""
    job = submit(client)
    report = {"step": 4, "generation": 0, "rank": 0, "world_size": 2, "ok": False, "error": "x"}
    report["context"] = {"metrics": {"loss": True}}
    resp = client.post(f"/v1/jobs/{job['id']}/workers/checkpoints", json=report, headers=AUTH)
    assert error(resp, 422)["field"] == "context.metrics.loss"


def test_the_readme_names_every_worker_event_the_service_takes() -> None:
    """The README's REST table lists what ``POST .../workers/events`` accepts: every kind, once."""
    from typing import get_args

    from service.jobs.events import WorkerEventKind

    readme = (Path(__file__).resolve().parents[4] / "README.md").read_text(encoding="utf-8")
    (row,) = [line for line in readme.splitlines() if line.startswith("| `POST /v1/jobs/{id}/workers/")]
    listed = row.split("`events` takes", 1)[1]
    missing = [kind for kind in get_args(WorkerEventKind) if f"`{kind}`" not in listed]
    assert not missing, f"README.md's worker callback row does not name {missing}"
