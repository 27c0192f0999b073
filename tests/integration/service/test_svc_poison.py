"""One job's bad data stops nothing for the others, against a real etcd
and the real service (uvicorn, the reconciler, the file-backed fake scheduler):

* job records written straight into etcd -- not JSON, JSON of the wrong shape, a valid record
  whose spec no longer validates, a state the code does not know -- next to healthy jobs: the
  healthy ones launch, run, scale and finish; each bad one is FAILED with the reason and
  counted; ``GET /v1/jobs`` and ``GET /v1/jobs/{id}`` answer for every job, before and after a
  restart of the service;
* a manifest nested 200,000 levels deep in a live job's and in a finished job's checkpoint
  directory: cancels still cancel, a crashed node is still replaced, ``/resume`` answers, and a
  restarted service (which reconciles every job's storage once) serves and reconciles.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from svc_process import QUICK_PASSES, ServiceProcess, job_spec, wait_for

from service.etcd.kv import EtcdStore
from service.etcd.server import EtcdServer
from service.jobs import keys

pytestmark = pytest.mark.integration

BOMB = b"[" * 200_000 + b"]" * 200_000


def _state(svc: ServiceProcess, job_id: str) -> str:
    with svc.client() as client:
        resp = client.get(f"/v1/jobs/{job_id}")
        assert resp.status_code == 200, resp.text
        state: str = resp.json()["state"]
        return state


def _poison(name: str, record: bytes) -> bytes:
    """What ``name`` writes over a job's ``record`` (its own, so that its nodes stay its own)."""
    raw = json.loads(record)
    if name == "invalid-spec":
        raw["spec"]["optimizer"] = {"lr": None}  # what 'lr: Infinity' was stored as
    elif name == "unknown-state":
        raw["state"] = "PAUSED"
    elif name == "wrong-shape":
        return b'{"id": 5, "nodes": "many"}'
    else:
        return b"\x00\xff not a record"
    return json.dumps(raw).encode()


def test_records_that_cannot_be_read_fail_their_jobs_only(tmp_path: Path, fresh_etcd: EtcdServer) -> None:
    svc = ServiceProcess(tmp_path, etcd=fresh_etcd.endpoint, env=QUICK_PASSES).start()
    store = EtcdStore(fresh_etcd.endpoint)
    try:
        with svc.client() as client:
            bad = {name: client.post("/v1/jobs", json=job_spec(name, "1")).json()["id"] for name in
                   ("not-json", "wrong-shape", "invalid-spec", "unknown-state")}  # fmt: skip
            wait_for(lambda: all(_state(svc, i) == "RUNNING" for i in bad.values()), what="all RUNNING")
            for name, job_id in bad.items():
                original = store.get(keys.job(job_id))
                assert original is not None
                store.put(keys.job(job_id), _poison(name, original.value))
            healthy = client.post("/v1/jobs", json=job_spec("healthy", "1:2")).json()["id"]
            wait_for(lambda: _state(svc, healthy) == "RUNNING", what="the healthy job RUNNING")
            wait_for(lambda: all(_state(svc, i) == "FAILED" for i in bad.values()), what="bad jobs FAILED")
            for name, job_id in bad.items():
                view = client.get(f"/v1/jobs/{job_id}").json()
                assert "cannot read" in view["reason"], (name, view)
                assert svc.metric("elastrain_reconciler_job_errors_total", job_id=job_id) == 1, name
            listed = client.get("/v1/jobs")
            assert listed.status_code == 200
            assert {j["id"]: j["state"] for j in listed.json()["jobs"]} == {
                **dict.fromkeys(bad.values(), "FAILED"),
                healthy: "RUNNING",
            }
            # Nodes whose records were readable are stopped; the healthy job still scales.
            cancelled = (svc.nodes_dir / "cancels.log").read_text().split()
            assert {f"{bad['invalid-spec']}-n0-a0", f"{bad['unknown-state']}-n0-a0"} <= set(cancelled)
            assert client.post(f"/v1/jobs/{healthy}/scale", json={"nodes": 1}).status_code == 202
        svc.kill9()
        svc = svc.again()
        before = svc.passes()
        wait_for(lambda: svc.passes() >= before + 3, what="passes after the restart")
        assert _state(svc, healthy) in ("RESCALING", "RUNNING")
        for launch_id in svc.launches():
            svc.set_status(launch_id, "succeeded", 0)
        wait_for(lambda: _state(svc, healthy) == "SUCCEEDED", what="the healthy job SUCCEEDED")
        assert all(_state(svc, i) == "FAILED" for i in bad.values())
    finally:
        store.client.close()
        assert svc.stop() == 0


def test_a_bomb_manifest_in_a_live_and_a_finished_job_stops_nothing(
    tmp_path: Path, fresh_etcd: EtcdServer
) -> None:
    svc = ServiceProcess(tmp_path, etcd=fresh_etcd.endpoint, env=QUICK_PASSES).start()
    try:
        with svc.client() as client:
            live, finished, other = (client.post("/v1/jobs", json=job_spec(n, "1")).json() for n in
                                     ("live", "finished", "other"))  # fmt: skip
            ids = [live["id"], finished["id"], other["id"]]
            wait_for(lambda: all(_state(svc, i) == "RUNNING" for i in ids), what="all RUNNING")
            svc.set_status(f"{finished['id']}-n0-a0", "succeeded", 0)
            wait_for(lambda: _state(svc, finished["id"]) == "SUCCEEDED", what="one job SUCCEEDED")
            for job in (live, finished):
                step = Path(job["checkpoint_dir"]) / "step-00000010"
                step.mkdir(parents=True)
                (step / "manifest.json").write_bytes(BOMB)
                (Path(job["checkpoint_dir"]) / "latest").write_text("step-00000010")
            resume = client.get(f"/v1/jobs/{live['id']}/resume?world_size=2")
            assert resume.status_code == 200 and resume.json()["checkpoint"] is None, resume.text
        svc.kill9()
        svc = svc.again()  # adopts every job's storage, the finished one's too
        with svc.client() as client:
            before = svc.passes()
            wait_for(lambda: svc.passes() >= before + 3, what="passes after the restart")
            assert client.delete(f"/v1/jobs/{other['id']}").status_code == 202
            wait_for(lambda: _state(svc, other["id"]) == "CANCELLED", what="the cancel")
            svc.set_status(f"{live['id']}-n0-a0", "failed", 1)  # a crashed node
            wait_for(lambda: f"{live['id']}-n0-a1" in svc.launches(), what="the crashed node replaced")
            assert client.get(f"/v1/jobs/{live['id']}/resume").status_code == 200
            assert httpx.get(f"{svc.url}/readyz", timeout=5).status_code == 200
    finally:
        assert svc.stop() == 0


def _db_size(endpoint: str) -> int:
    """The bytes etcd's database holds (its maintenance status: ``dbSizeInUse``; ``dbSize``, the
    file, grows in whole bbolt pages and allocations)."""
    status = httpx.post(f"{endpoint}/v3/maintenance/status", json={}, timeout=5).json()
    return int(status.get("dbSizeInUse", status["dbSize"]))


def test_a_flooding_worker_cannot_fill_etcd(tmp_path: Path, fresh_etcd: EtcdServer) -> None:
    """30 reports of 1 MB with distinct steps from one worker token must not grow etcd without bound."""
    svc = ServiceProcess(tmp_path, etcd=fresh_etcd.endpoint).start()
    try:
        with svc.client() as client:
            job = client.post("/v1/jobs", json=job_spec("flood", "2", max_steps=1000)).json()
            healthy = client.post("/v1/jobs", json=job_spec("healthy", "1")).json()["id"]
            wait_for(lambda: _state(svc, job["id"]) == "RUNNING", what="the job RUNNING")
        token = svc.launch_env(f"{job['id']}-n0-a0")["ELASTRAIN_WORKER_TOKEN"]
        worker = httpx.Client(base_url=f"{svc.url}/v1/jobs/{job['id']}/workers", timeout=30,
                              headers={"Authorization": f"Bearer {token}"})  # fmt: skip
        before = _db_size(fresh_etcd.endpoint)
        pad = "x" * 900_000  # each body just under the 1 MiB limit
        answers = []
        for step in range(1, 31):
            body = {"step": step, "generation": 0, "rank": 0, "world_size": 2, "ok": True, "error": "",
                    "files": {}, "pieces": [], "tensors": {}, "meta_digest": "",
                    "rank_meta": {"pad": pad}, "context": {}}  # fmt: skip
            answers.append(worker.post("/checkpoints", json=body).status_code)
        beats = [
            worker.post("/heartbeat", json={"launch_id": f"made-up-{i}", "local_rank": 0}).status_code
            for i in range(50)
        ]
        grown = _db_size(fresh_etcd.endpoint) - before
        print(
            f"etcd grew {grown / 1e6:.1f} MB under the flood (reports: {answers}; heartbeats: {set(beats)})"
        )
        assert answers == [200] * 4 + [429] * 26 and set(beats) == {422}
        # Unbounded, the same flood grew etcd by 46 MB. Four admitted reports of 0.9 MB, and the
        # history etcd keeps of every key until it compacts (the job records rewritten meanwhile),
        # measured 3.6 to 9 MB on a loaded machine.
        assert grown < 16e6, f"etcd grew by {grown / 1e6:.1f} MB"
        assert svc.metric("elastrain_api_worker_throttled_total", job_id=job["id"]) == 26
        # The job ends: its token stops working and its keys go.
        for launch_id in svc.launches():
            if launch_id.startswith(job["id"]):
                svc.set_status(launch_id, "succeeded", 0)
        wait_for(lambda: _state(svc, job["id"]) == "SUCCEEDED", what="the job SUCCEEDED")
        late = worker.post("/heartbeat", json={"launch_id": f"{job['id']}-n0-a0", "local_rank": 0})
        assert late.status_code == 409, late.text
        store = EtcdStore(fresh_etcd.endpoint)
        for prefix in keys.job_prefixes(job["id"]):
            assert store.list_prefix(prefix, keys_only=True) == [], prefix
        store.client.close()
        worker.close()
        assert _state(svc, healthy) == "RUNNING"
    finally:
        assert svc.stop() == 0
