"""Control-plane rows: ``kill -9`` of the service (real uvicorn + etcd, the file-backed fake
scheduler of tests/integration/service) in the middle of a submit and of a scale, then a
restart on the same etcd and data dir.

Invariants: one Idempotency-Key gives one job however the kill lands (every answer names the
same id, the job is launched once per node); after a scale the state converges to the asked
size, each node is launched once, and the node that was already training is neither cancelled
nor relaunched (a control-plane restart does not interrupt training).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from svc_process import ServiceProcess, job_spec, wait_for

from service.etcd.server import EtcdServer
from tests.faults.conftest import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
SPEC: dict[str, Any] = job_spec("faults", "1:3")


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[ServiceProcess]:
    with EtcdServer(tmp_path / "etcd") as etcd:
        proc = ServiceProcess(tmp_path, etcd=etcd.endpoint).start()
        try:
            yield proc
        finally:
            proc.stop()


def post(svc: ServiceProcess, spec: dict[str, Any], key: str) -> tuple[int, str | None]:
    headers = {"Authorization": f"Bearer {svc.token}", "Idempotency-Key": key}
    try:
        resp = httpx.post(f"{svc.url}/v1/jobs", json=spec, headers=headers, timeout=10)
    except httpx.HTTPError:
        return -1, None  # the kill cut the connection
    return resp.status_code, resp.json().get("id") if resp.status_code < 300 else None


@seeded
def test_kill9_during_submit_with_idempotency_key(svc: ServiceProcess, seed: int) -> None:
    rng = random.Random(seed)
    spec, key = SPEC | {"name": f"idem-{seed}"}, f"key-{seed}"
    delay = rng.uniform(0.0, 0.4)
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(post, svc, spec, key) for _ in range(16)]
        time.sleep(delay)
        svc.kill9()
        before = [f.result() for f in futures]
    svc.start()
    status, job_id = post(svc, spec, key)
    what = f"seed={seed} delay={delay:.2f}s answers={sorted(before, key=str)}"
    assert status in (200, 201) and job_id, what
    assert {i for s, i in before if i is not None} <= {job_id}, what
    assert all(s in (-1, 200, 201) for s, _ in before), what
    with svc.client() as client:
        jobs = client.get("/v1/jobs", params={"limit": 500}).json()["jobs"]
        assert [j["name"] for j in jobs].count(spec["name"]) == 1, what
        wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json()["state"] == "RUNNING", what="RUNNING")
    launched = [x for x in svc.launches() if x.startswith(job_id)]
    assert sorted(launched) == [f"{job_id}-n{i}-a0" for i in range(3)], what


def scale(svc: ServiceProcess, job_id: str, nodes: int) -> int:
    try:
        with svc.client() as client:
            return client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": nodes}).status_code
    except httpx.HTTPError:
        return -1


@seeded
def test_kill9_during_scale_converges(svc: ServiceProcess, seed: int) -> None:
    rng = random.Random(seed)
    target, delay = rng.choice([2, 3]), rng.uniform(0.0, 0.3)
    with svc.client() as client:
        job_id = client.post("/v1/jobs", json=SPEC | {"initial_nodes": 1}).json()["id"]
        wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json()["state"] == "RUNNING", what="RUNNING")
        first = f"{job_id}-n0-a0"
        assert svc.launches() == [first]
        with ThreadPoolExecutor(max_workers=1) as pool:  # the kill lands before, during or after it
            scaled = pool.submit(scale, svc, job_id, target)
            time.sleep(delay)
            svc.kill9()
            scaled.result()
    svc.start()
    what = f"seed={seed} target={target} delay={delay:.2f}s"
    with svc.client() as client:
        assert client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": target}).status_code == 202, what
        want = sorted(f"{job_id}-n{i}-a0" for i in range(target))
        wait_for(lambda: sorted(svc.launches()) == want, timeout_s=60, what=f"{target} nodes; {what}")
        got = client.get(f"/v1/jobs/{job_id}").json()
    assert [n["phase"] for n in got["nodes"]].count("running") == target, f"{what}: {got['nodes']}"
    cancels = svc.nodes_dir / "cancels.log"
    assert first not in (cancels.read_text() if cancels.exists() else ""), f"{what}: node 0 was cancelled"
    assert sorted(svc.launches()) == want, f"{what}: {svc.launches()}"
