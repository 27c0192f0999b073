"""Two real services on one etcd, sharing one API token as the chart's replicas share its
Secret: every write sent to the standby reaches the leader (forwarded), and its answer comes
back unchanged. Worker heartbeats are the case that matters: they are not retried, so behind a
Service with two replicas a rank whose beats landed on the standby could be declared lost."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from svc_process import ServiceProcess, job_spec, wait_for

from service.etcd.election import leader_address
from service.etcd.kv import EtcdStore
from service.etcd.server import EtcdServer
from service.jobs import keys
from service.ports import free_port

pytestmark = pytest.mark.integration

SPEC: dict[str, Any] = job_spec("fwd", "1:2", initial_nodes=1)


def test_a_standby_forwards_writes_to_the_leader(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    token = secrets.token_urlsafe(24)
    with EtcdServer(tmp_path / "etcd") as etcd:
        a = ServiceProcess(tmp_path / "a", etcd=etcd.endpoint, token=token).start()
        b = ServiceProcess(tmp_path / "b", etcd=etcd.endpoint, token=token)
        b.nodes_dir = a.nodes_dir  # one scheduler, as on a cluster
        try:
            wait_for(lambda: httpx.get(f"{a.url}/readyz").json()["leader"], what="a leads")
            b.start()
            assert httpx.get(f"{b.url}/readyz").json()["leader"] is False
            with a.client() as on_a, b.client() as on_b:
                created = on_b.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "k1"})
                assert created.status_code == 201, created.text
                assert len(created.headers.get_list("date")) == 1  # the relay's own, not both
                job = created.json()["id"]
                again = on_a.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "k1"})
                assert again.json()["id"] == job  # the leader applied it: one job
                assert [j["id"] for j in on_a.get("/v1/jobs").json()["jobs"]] == [job]

                launch = f"{job}-n0-a0"
                wait_for(lambda: launch in a.launches(), what="launch")
                wait_for(lambda: on_a.get(f"/v1/jobs/{job}").json()["state"] == "RUNNING", what="RUNNING")
                env = a.launch_env(launch)
                worker = {"Authorization": f"Bearer {env['ELASTRAIN_WORKER_TOKEN']}"}
                beat = on_b.post(
                    f"/v1/jobs/{job}/workers/heartbeat",
                    json={"launch_id": launch, "local_rank": 0, "step": 3},
                    headers=worker,
                )
                assert beat.status_code == 200 and beat.json()["cancel_requested"] is False, beat.text
                # the leader took it: it reaches etcd with the leader's next batch of beats
                stored = wait_for(
                    lambda: EtcdStore([etcd.endpoint]).get(keys.heartbeat(job, launch, 0)), what="the beat"
                )
                assert b'"step": 3' in stored.value

                assert on_b.get(f"/v1/jobs/{job}").json()["desired_nodes"] == 1  # b caches its view
                scaled = on_b.post(f"/v1/jobs/{job}/scale", json={"nodes": 2})
                assert scaled.status_code == 202, scaled.text
                assert on_a.get(f"/v1/jobs/{job}").json()["desired_nodes"] == 2
                assert on_b.get(f"/v1/jobs/{job}").json()["desired_nodes"] == 2  # reads its own write

                # The leader's refusals come back as they are, not as the standby's.
                bad = on_b.post(f"/v1/jobs/{job}/scale", json={"nodes": 7})
                assert bad.status_code == 422 and "nodes" in bad.text
                # A request without a valid token is refused by the standby itself, never relayed.
                wrong = httpx.post(f"{b.url}/v1/jobs", json=SPEC, headers={"Authorization": "Bearer nope"})
                assert wrong.status_code == 401
                # A request forwarded once is never forwarded again (no loops across a failover).
                looped = on_b.post(
                    f"/v1/jobs/{job}/scale", json={"nodes": 1}, headers={"X-Elastrain-Forwarded-By": "x"}
                )
                assert looped.status_code == 503 and "not the leader" in looped.text
            FORWARDED = "elastrain_api_forwarded_total"
            assert b.metric(FORWARDED, outcome="forwarded") == 4 and a.metric(FORWARDED) == 0
        finally:
            a.stop()
            b.stop()


def test_a_standby_passes_workers_calls_to_the_leaders_workers_listener(tmp_path: Path) -> None:
    """Both replicas with a workers' port: the leader publishes its workers' listener, and a
    heartbeat that reached the standby's workers' port is applied by the leader through it
    (which port it took is the unit tests' part: tests/unit/service/api/test_forward.py)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    token = secrets.token_urlsafe(24)
    ports = {"a": free_port(), "b": free_port()}
    with EtcdServer(tmp_path / "etcd") as etcd:
        a = ServiceProcess(
            tmp_path / "a", etcd=etcd.endpoint, token=token, env={"ELASTRAIN_WORKER_PORT": str(ports["a"])}
        ).start()
        b = ServiceProcess(
            tmp_path / "b", etcd=etcd.endpoint, token=token, env={"ELASTRAIN_WORKER_PORT": str(ports["b"])}
        )
        b.nodes_dir = a.nodes_dir
        try:
            wait_for(lambda: httpx.get(f"{a.url}/readyz").json()["leader"], what="a leads")
            b.start()
            store = EtcdStore([etcd.endpoint])
            assert leader_address(store, workers=True) == f"http://127.0.0.1:{ports['a']}"
            with a.client() as on_a:
                job = on_a.post("/v1/jobs", json=SPEC).json()["id"]
                launch = f"{job}-n0-a0"
                wait_for(lambda: on_a.get(f"/v1/jobs/{job}").json()["state"] == "RUNNING", what="RUNNING")
                env = a.launch_env(launch)
                assert env["ELASTRAIN_SERVICE_URL"] == f"http://127.0.0.1:{ports['a']}"
            beat = httpx.post(
                f"http://127.0.0.1:{ports['b']}/v1/jobs/{job}/workers/heartbeat",
                json={"launch_id": launch, "local_rank": 0, "step": 4},
                headers={"Authorization": f"Bearer {env['ELASTRAIN_WORKER_TOKEN']}"},
            )
            assert beat.status_code == 200, beat.text
            stored = wait_for(lambda: store.get(keys.heartbeat(job, launch, 0)), what="the beat")
            assert b'"step": 4' in stored.value
            assert b.metric("elastrain_api_forwarded_total", outcome="forwarded") == 1
        finally:
            a.stop()
            b.stop()
