"""The local scheduler's queue in the real service on a real etcd (the fake file scheduler: no
process runs, a test says when a node ends): jobs that do not fit wait in QUEUED and start by
priority, then submission; a queued job cancels without a launch; the queue survives a kill -9
of the service and a change of leader."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from svc_process import QUICK_PASSES, ServiceProcess, job_spec, wait_for

from service.etcd.server import EtcdServer

pytestmark = pytest.mark.integration

SLOTS = QUICK_PASSES | {"ELASTRAIN_LOCAL_SLOTS": "2"}


def job(svc: ServiceProcess, job_id: str) -> dict[str, Any]:
    with svc.client() as client:
        body: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
        return body


def submit(svc: ServiceProcess, name: str, nodes: str, **more: Any) -> str:
    with svc.client() as client:
        answer = client.post("/v1/jobs", json=job_spec(name, nodes, **more))
        assert answer.status_code == 201, answer.text
        job_id: str = answer.json()["id"]
        return job_id


def launched_by(svc: ServiceProcess, job_id: str) -> list[str]:
    return [launch for launch in svc.launches() if launch.startswith(job_id + "-")]


def state(svc: ServiceProcess, job_id: str, want: str) -> dict[str, Any] | None:
    body = job(svc, job_id)
    return body if body["state"] == want else None


def end(svc: ServiceProcess, job_id: str) -> None:
    for launch_id in launched_by(svc, job_id):
        svc.set_status(launch_id, "succeeded", 0)
    wait_for(lambda: state(svc, job_id, "SUCCEEDED"), what=f"{job_id} SUCCEEDED")


def test_the_queue_orders_by_priority_cancels_queued_jobs_and_survives_a_restart(
    tmp_path: Path, fresh_etcd: EtcdServer
) -> None:
    svc = ServiceProcess(tmp_path, etcd=fresh_etcd.endpoint, env=SLOTS).start()
    try:
        first = submit(svc, "first", "2")
        wait_for(lambda: state(svc, first, "RUNNING"), what="the first job RUNNING")
        gang = submit(svc, "gang", "2")
        urgent = submit(svc, "urgent", "1", priority=5)
        dropped = submit(svc, "dropped", "1")
        queued = wait_for(lambda: state(svc, dropped, "QUEUED"), what="the last job QUEUED")
        assert queued["queue_position"] == 3 and "waits for 1 free slots" in queued["waiting"]
        assert job(svc, urgent)["queue_position"] == 1 and job(svc, gang)["queue_position"] == 2
        with svc.client() as client:
            listed = client.get("/v1/jobs", params={"state": "QUEUED"}).json()["jobs"]
            assert {j["id"]: j["queue_position"] for j in listed} == {urgent: 1, gang: 2, dropped: 3}
            assert client.delete(f"/v1/jobs/{dropped}").status_code == 202
        wait_for(lambda: state(svc, dropped, "CANCELLED"), what="the queued job CANCELLED")
        assert launched_by(svc, dropped) == []  # it never launched

        svc.kill9()
        svc = svc.again()
        assert job(svc, urgent)["state"] == job(svc, gang)["state"] == "QUEUED"
        assert job(svc, urgent)["queue_position"] == 1
        assert launched_by(svc, urgent) == launched_by(svc, gang) == []

        end(svc, first)  # two slots free: the urgent job (1) starts; the gang (2) does not fit in 1
        wait_for(lambda: state(svc, urgent, "RUNNING"), what="the urgent job RUNNING")
        waits = job(svc, gang)
        assert waits["state"] == "QUEUED" and waits["queue_position"] == 1
        assert "waits for 2 free slots" in waits["waiting"] and "1 of 2 are free" in waits["waiting"]
        end(svc, urgent)
        wait_for(lambda: state(svc, gang, "RUNNING"), what="the gang job RUNNING")
        assert len(launched_by(svc, gang)) == 2
    finally:
        assert svc.stop() == 0


def test_a_new_leader_keeps_the_queue_and_starts_the_next_job(tmp_path: Path, fresh_etcd: EtcdServer) -> None:
    token = secrets.token_urlsafe(24)
    a = ServiceProcess(tmp_path, etcd=fresh_etcd.endpoint, env=SLOTS, token=token).start()
    b: ServiceProcess | None = None
    try:
        wait_for(lambda: httpx.get(f"{a.url}/readyz").json()["leader"], what="a leads")
        b = ServiceProcess(tmp_path, etcd=fresh_etcd.endpoint, env=SLOTS, token=token).start()
        first = submit(a, "first", "2")
        wait_for(lambda: state(a, first, "RUNNING"), what="the first job RUNNING")
        second = submit(a, "second", "1")
        wait_for(lambda: state(a, second, "QUEUED"), what="the second job QUEUED")

        a.kill9()
        wait_for(lambda: httpx.get(f"{b.url}/readyz").json()["leader"], timeout_s=60, what="b leads")
        assert job(b, second)["state"] == "QUEUED" and launched_by(b, second) == []
        end(b, first)
        wait_for(lambda: state(b, second, "RUNNING"), what="the second job RUNNING under the new leader")
    finally:
        if b is not None:
            assert b.stop() == 0
        a.stop()
