"""A real 3-member etcd cluster under the service (fake scheduler): lose one member and the
service keeps serving (ready, a job submitted and launched); lose two and ``/readyz`` answers
503 and nothing is launched; bring them back and it catches up (ready, the queued state intact,
a new job launched).

With the fake scheduler nothing runs on the nodes: the row checks the control plane alone (fast,
many seeded trials). ``test_real_service.py::test_real_etcd_quorum`` runs it with a real job."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from svc_process import ServiceProcess, job_spec, wait_for

from tests.faults.etcd_cluster import EtcdCluster
from tests.seeds import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
SPEC: dict[str, Any] = job_spec("quorum", "1")


def ready(svc: ServiceProcess) -> int:
    try:
        return httpx.get(f"{svc.url}/readyz", timeout=10).status_code
    except httpx.HTTPError:
        return -1


def submit_and_launch(svc: ServiceProcess, name: str, what: str) -> str:
    with svc.client() as client:
        resp = client.post("/v1/jobs", json=SPEC | {"name": name})
        assert resp.status_code == 201, f"{what}: {resp.status_code} {resp.text}"
        job_id: str = resp.json()["id"]
    wait_for(lambda: f"{job_id}-n0-a0" in svc.launches(), timeout_s=60, what=f"launch of {name}; {what}")
    return job_id


@seeded
def test_lose_one_then_two_etcd_members(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    first, second = rng.sample(range(3), 2)
    what = f"seed={seed} lost m{first} then m{second}"
    with EtcdCluster(tmp_path / "etcd") as cluster:
        svc = ServiceProcess(tmp_path, etcd=cluster.endpoints).start()
        try:
            cluster.kill_member(first)
            wait_for(lambda: ready(svc) == 200, timeout_s=30, what=f"ready with 2 of 3; {what}")
            one = submit_and_launch(svc, "one-lost", what)
            cluster.kill_member(second)
            wait_for(lambda: ready(svc) == 503, timeout_s=60, what=f"/readyz 503 with 1 of 3; {what}")
            launched = list(svc.launches())
            refused = svc.client().post("/v1/jobs", json=SPEC | {"name": "no-quorum"}, timeout=30)
            assert refused.status_code == 503, f"{what}: {refused.status_code} {refused.text}"
            time.sleep(2)
            assert svc.launches() == launched, f"{what}: launched without quorum"
            cluster.start_member(first)
            cluster.start_member(second)
            cluster.wait_healthy([0, 1, 2])
            wait_for(lambda: ready(svc) == 200, timeout_s=60, what=f"ready again; {what}")
            with svc.client() as client:
                assert client.get(f"/v1/jobs/{one}").status_code == 200, what
            submit_and_launch(svc, "caught-up", what)
            assert svc.proc is not None and svc.proc.poll() is None, f"{what}: the service died"
        finally:
            svc.stop()
