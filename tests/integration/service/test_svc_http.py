"""The real service over HTTP (uvicorn, etcd, reconciler; fake scheduler): the job lifecycle,
the bad-input matrix (never a 500), worker tokens, idempotent concurrent submissions."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from svc_process import ServiceProcess, job_spec, wait_for

pytestmark = pytest.mark.integration

SPEC: dict[str, Any] = job_spec("http", "1:3", optimizer={"betas": [0.9, 0.99]})


def submit(client: httpx.Client, **change: Any) -> dict[str, Any]:
    resp = client.post("/v1/jobs", json=SPEC | change)
    assert resp.status_code == 201, resp.text
    body: dict[str, Any] = resp.json()
    return body


def state(client: httpx.Client, job_id: str) -> str:
    return str(client.get(f"/v1/jobs/{job_id}").json()["state"])


def test_lifecycle_submit_run_scale_cancel(module_service: ServiceProcess) -> None:
    svc = module_service
    with svc.client() as client:
        job = submit(client, nodes="2:3")
        job_id = job["id"]
        wait_for(lambda: state(client, job_id) == "RUNNING", what="RUNNING")
        assert sorted(x for x in svc.launches() if x.startswith(job_id)) == [
            f"{job_id}-n{i}-a0" for i in range(3)
        ]
        listed = client.get("/v1/jobs", params={"state": "RUNNING"}).json()["jobs"]
        assert job_id in [j["id"] for j in listed]
        scaled = client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": 2})
        assert scaled.status_code == 202
        wait_for(lambda: state(client, job_id) == "RESCALING", what="RESCALING")
        got = client.get(f"/v1/jobs/{job_id}").json()
        assert [n["phase"] for n in got["nodes"]].count("running") == 2
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 202
        wait_for(lambda: state(client, job_id) == "CANCELLED", what="CANCELLED")
        assert client.delete(f"/v1/jobs/{job_id}").json()["state"] == "CANCELLED"  # idempotent


def test_job_succeeds_when_its_nodes_exit_zero(module_service: ServiceProcess) -> None:
    svc = module_service
    with svc.client() as client:
        job_id = submit(client, nodes="1")["id"]
        wait_for(lambda: state(client, job_id) == "RUNNING", what="RUNNING")
        svc.set_status(f"{job_id}-n0-a0", "succeeded", 0)
        wait_for(lambda: state(client, job_id) == "SUCCEEDED", what="SUCCEEDED")


def test_node_failure_is_recovered_and_counted(module_service: ServiceProcess) -> None:
    svc = module_service
    with svc.client() as client:
        # The restart path on purpose: in peer mode (the default for DDP) a lost node is not a restart.
        job_id = submit(client, nodes="1", max_restarts=1, recovery={"mode": "restart"})["id"]
        wait_for(lambda: state(client, job_id) == "RUNNING", what="RUNNING")
        svc.set_status(f"{job_id}-n0-a0", "failed", 137)
        wait_for(lambda: f"{job_id}-n0-a1" in svc.launches(), what="relaunch")
        got = client.get(f"/v1/jobs/{job_id}").json()
        assert got["restarts"] == 1 and got["state"] == "RECOVERING"
        svc.set_status(f"{job_id}-n0-a1", "failed", 1)
        wait_for(lambda: state(client, job_id) == "FAILED", what="FAILED")
        assert "max_restarts" in client.get(f"/v1/jobs/{job_id}").json()["reason"]


def test_worker_token_reaches_only_its_own_job(module_service: ServiceProcess) -> None:
    svc = module_service
    with svc.client() as client:
        mine, other = submit(client, nodes="1")["id"], submit(client, nodes="1")["id"]
        wait_for(lambda: f"{mine}-n0-a0" in svc.launches(), what="launch")
        env = svc.launch_env(f"{mine}-n0-a0")
        assert env["ELASTRAIN_SERVICE_URL"] == svc.url and env["ELASTRAIN_JOB_ID"] == mine
        worker = {"Authorization": f"Bearer {env['ELASTRAIN_WORKER_TOKEN']}"}
        beat = {"launch_id": f"{mine}-n0-a0", "local_rank": 0, "step": 1}
        ok = httpx.post(f"{svc.url}/v1/jobs/{mine}/workers/heartbeat", json=beat, headers=worker)
        assert ok.status_code == 200 and ok.json()["cancel_requested"] is False
        progress = {"step": 12, "samples_per_s": 50.0, "loss": 0.5, "world_size": 1}
        assert httpx.post(
            f"{svc.url}/v1/jobs/{mine}/workers/progress", json=progress, headers=worker
        ).is_success
        assert httpx.get(f"{svc.url}/v1/jobs/{mine}/resume", headers=worker).json()["checkpoint"] is None
        denied = httpx.post(f"{svc.url}/v1/jobs/{other}/workers/heartbeat", json=beat, headers=worker)
        assert denied.status_code == 403 and mine in denied.json()["error"]["message"]
        assert httpx.get(f"{svc.url}/v1/jobs", headers=worker).status_code == 403
        assert client.get(f"/v1/jobs/{mine}").json()["step"] == 12


LIST_JOBS, BEARER = "list jobs with GET /v1/jobs", "send 'Authorization: Bearer <token>'"
# (method, path, body, extra headers, status, the JSON "field", what the message tells to do)
BAD_INPUTS: list[tuple[str, str, Any, dict[str, str], int, str | None, str]] = [
    ("POST", "/v1/jobs", b"{oops", {}, 400, None, "send a JobSpec"),
    ("POST", "/v1/jobs", b"[]", {}, 422, "body", "JSON object"),
    ("POST", "/v1/jobs", b'"a string"', {}, 422, "body", "JSON object"),
    ("POST", "/v1/jobs", json.dumps(SPEC | {"max_steps": "10"}).encode(), {}, 422, "max_steps",
     "give a whole number without quotes"),
    ("POST", "/v1/jobs", json.dumps(SPEC | {"max_steps": -1}).encode(), {}, 422, "max_steps",
     "give a larger value"),
    ("POST", "/v1/jobs", json.dumps(SPEC | {"surprise": True}).encode(), {}, 422, "surprise", "remove it"),
    ("POST", "/v1/jobs", json.dumps(SPEC | {"checkpoint": {"dir": "../../../etc"}}).encode(), {}, 422,
     "checkpoint.dir", "without '..'"),
    ("POST", "/v1/jobs", json.dumps(SPEC | {"checkpoint": {"dir": "/"}}).encode(), {}, 422, "checkpoint.dir",
     "give a relative directory name"),
    ("POST", "/v1/jobs", json.dumps(SPEC | {"checkpoint": {"resume": "../x"}}).encode(), {}, 422,
     "checkpoint.resume", "without '..'"),
    ("POST", "/v1/jobs", json.dumps(SPEC | {"name": "Bad Name"}).encode(), {}, 422, "name",
     "use lowercase letters"),
    ("POST", "/v1/jobs", b"{" + b" " * (2 << 20) + b"}", {}, 413, None, "send a smaller body"),
    ("POST", "/v1/jobs", json.dumps(SPEC).encode(), {"Authorization": ""}, 401, None,
     BEARER),
    ("POST", "/v1/jobs", json.dumps(SPEC).encode(), {"Authorization": "Bearer wrong"}, 401, None,
     "API token"),
    ("GET", "/v1/jobs", None, {"Authorization": "Basic abc"}, 401, None, BEARER),
    ("GET", "/v1/jobs?limit=0", None, {}, 422, "limit", "give a larger value"),
    ("GET", "/v1/jobs?limit=abc", None, {}, 422, "limit", "give decimal digits"),
    ("GET", "/v1/jobs/does-not-exist", None, {}, 404, None, LIST_JOBS),
    ("GET", "/v1/jobs/%00", None, {}, 404, None, LIST_JOBS),
    ("DELETE", "/v1/jobs/does-not-exist", None, {}, 404, None, LIST_JOBS),
    ("POST", "/v1/jobs/does-not-exist/scale", b'{"nodes": 1}', {}, 404, None, LIST_JOBS),
    ("GET", "/v1/jobs/does-not-exist/checkpoints", None, {}, 404, None, LIST_JOBS),
    ("POST", "/v1/jobs/does-not-exist/workers/checkpoints", b"{}", {}, 404, None, LIST_JOBS),
    ("GET", "/v1/nothing-here", None, {}, 404, None, "see /openapi.json"),
    ("PUT", "/v1/jobs", b"{}", {}, 405, None, "see /openapi.json"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "field", "fix"), BAD_INPUTS)
def test_bad_input_is_a_clear_4xx_naming_the_field_and_the_fix(
    module_service: ServiceProcess,
    method: str,
    path: str,
    body: bytes | None,
    headers: dict[str, str],
    status: int,
    field: str | None,
    fix: str,
) -> None:
    auth = {"Authorization": f"Bearer {module_service.token}", "Content-Type": "application/json"}
    resp = httpx.request(method, module_service.url + path, content=body, headers=auth | headers, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] and error["field"] == field, error
    assert fix in error["message"], f"the message does not say what to do ({fix!r}): {error['message']}"
    if field is not None:
        assert f"field '{field}'" in error["message"] or field == "body", error["message"]


def test_scale_and_report_errors_over_http(module_service: ServiceProcess) -> None:
    with module_service.client() as client:
        job_id = submit(client, nodes="1:2")["id"]
        assert client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": 3}).status_code == 422
        assert client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": "2"}).status_code == 422
        assert client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": True}).status_code == 422
        bad = client.post(f"/v1/jobs/{job_id}/workers/checkpoints", content=b'{"step": 1}')
        assert bad.status_code == 422 and "report" in bad.json()["error"]["message"]


def test_concurrent_submissions_with_one_key_create_one_job(module_service: ServiceProcess) -> None:
    headers = {"Authorization": f"Bearer {module_service.token}", "Idempotency-Key": "same-key-100"}
    spec = SPEC | {"name": "idem"}

    def post(_: int) -> tuple[int, str]:
        resp = httpx.post(f"{module_service.url}/v1/jobs", json=spec, headers=headers, timeout=60)
        return resp.status_code, resp.json()["id"]

    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(post, range(100)))
    assert {status for status, _ in results} <= {200, 201}
    assert [status for status, _ in results].count(201) == 1
    assert len({job_id for _, job_id in results}) == 1
    with module_service.client() as client:
        names = [j["name"] for j in client.get("/v1/jobs", params={"limit": 500}).json()["jobs"]]
    assert names.count("idem") == 1


def test_health_metrics_and_openapi(module_service: ServiceProcess) -> None:
    url = module_service.url
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{url}/readyz").json()
    assert ready["ready"] is True and ready["leader"] is True
    metrics = httpx.get(f"{url}/metrics").text
    assert "elastrain_reconciler_is_leader 1.0" in metrics and "elastrain_api_requests_total" in metrics
    schema = httpx.get(f"{url}/openapi.json").json()
    assert "/v1/jobs/{job_id}/resume" in schema["paths"] and "JobSpec" in schema["components"]["schemas"]
