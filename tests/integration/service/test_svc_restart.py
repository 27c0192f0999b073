"""kill -9 the service and start it again: no job is lost and no node is launched twice,
with an external etcd and with the embedded one (which dies with the service)."""

from __future__ import annotations

from pathlib import Path

import pytest
from svc_process import QUICK_PASSES, ServiceProcess, job_spec, wait_for

from service.etcd.kv import EtcdStore, put_if
from service.etcd.server import EtcdServer
from service.jobs import keys
from service.jobs.model import JobRecord, JobState, NodePhase

pytestmark = pytest.mark.integration

SPEC = job_spec("restart", "2")


def _states(svc: ServiceProcess, ids: list[str]) -> dict[str, str]:
    with svc.client() as client:
        return {i: client.get(f"/v1/jobs/{i}").json()["state"] for i in ids}


@pytest.mark.parametrize("embedded", [False, True], ids=["external-etcd", "embedded-etcd"])
def test_kill9_restart_keeps_jobs_and_launches_nothing_twice(tmp_path: Path, embedded: bool) -> None:
    etcd = None if embedded else EtcdServer(tmp_path / "etcd").start()
    svc = ServiceProcess(
        tmp_path, etcd="" if embedded else etcd.endpoint if etcd else "", env=QUICK_PASSES
    ).start()
    try:
        with svc.client() as client:
            ids = [client.post("/v1/jobs", json=SPEC).json()["id"] for _ in range(3)]
        wait_for(lambda: set(_states(svc, ids).values()) == {"RUNNING"}, what="all RUNNING")
        with svc.client() as client:
            assert client.post(f"/v1/jobs/{ids[1]}/scale", json={"nodes": 2}).status_code == 202
        launched = svc.launches()
        assert len(launched) == 6
        token = svc.token

        svc.kill9()
        svc = svc.again()
        assert svc.token == token  # the generated token survives
        assert _states(svc, ids) == dict.fromkeys(ids, "RUNNING")
        wait_for(lambda: svc.passes() >= 5, timeout_s=60, what="five reconciler passes after the restart")
        assert sorted(svc.launches()) == sorted(launched)

        for launch_id in launched:
            svc.set_status(launch_id, "succeeded", 0)
        wait_for(lambda: set(_states(svc, ids).values()) == {"SUCCEEDED"}, what="all SUCCEEDED")
        assert sorted(svc.launches()) == sorted(launched)
    finally:
        assert svc.stop() == 0
        if etcd is not None:
            etcd.stop()


def test_kill9_between_launch_and_recording_the_handle(tmp_path: Path, fresh_etcd: EtcdServer) -> None:
    """The record still says 'launching' (no handle) but the node was started: the new leader
    launches again under the same launch id, which the scheduler answers without a new start."""
    svc = ServiceProcess(tmp_path, etcd=fresh_etcd.endpoint).start()
    try:
        with svc.client() as client:
            job_id = client.post("/v1/jobs", json=SPEC | {"nodes": "1"}).json()["id"]
        wait_for(lambda: _states(svc, [job_id])[job_id] == "RUNNING", what="RUNNING")
        svc.kill9()
        store = EtcdStore(fresh_etcd.endpoint)
        found = store.get(keys.job(job_id))
        assert found is not None
        record = JobRecord.from_json(found.value)
        node = record.nodes[0].model_copy(update={"handle": None, "phase": NodePhase.LAUNCHING})
        crashed = record.model_copy(update={"nodes": (node,), "state": JobState.LAUNCHING})
        assert put_if(store, keys.job(job_id), crashed.to_json(), found.mod_revision)

        svc = svc.again()
        wait_for(lambda: _states(svc, [job_id])[job_id] == "RUNNING", what="RUNNING again")
        with svc.client() as client:
            nodes = client.get(f"/v1/jobs/{job_id}").json()["nodes"]
        assert [(n["attempt"], n["handle"]) for n in nodes] == [(0, f"file://{job_id}-n0-a0")]
        assert svc.launches() == [f"{job_id}-n0-a0"]
    finally:
        svc.stop()
