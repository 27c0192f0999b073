"""Peer recovery, the control plane's half, with the real service (uvicorn, etcd, the reconciler, the
file-backed fake scheduler) and a FAKE worker group: this test posts the peer contract's events
with the job's worker token, as the workers' rank 0 would, and sets the node apps' fates.

One incident is one recovery whichever the service hears first (the lost node, or the workers'
report); a promoted spare becomes its slot's member and a new spare is launched; the workers'
``desired`` key follows every scale; the phases are recorded; the metrics split by kind. In
restart mode a node lost with the re-formation it causes is one recovery, timed from the node's
end as its scheduler recorded it."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from svc_process import ServiceProcess, job_spec, wait_for

from service.etcd.kv import EtcdStore
from service.jobs import keys

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def svc(module_service: ServiceProcess) -> ServiceProcess:
    """The module's one service and etcd (conftest.py)."""
    return module_service


class Workers:
    """A fake worker group of one job: what its ranks would post, with the job's worker token."""

    def __init__(self, svc: ServiceProcess, job_id: str) -> None:
        self.svc, self.job_id = svc, job_id
        token = svc.launch_env(f"{job_id}-n0-a0")["ELASTRAIN_WORKER_TOKEN"]
        self.http = httpx.Client(
            base_url=f"{svc.url}/v1/jobs/{job_id}/workers", headers={"Authorization": f"Bearer {token}"}
        )

    def event(self, kind: str, **fields: Any) -> None:
        answer = self.http.post("/events", json={"kind": kind, "rank": 0, **fields})
        assert answer.status_code == 200, answer.text

    def progress(self, step: int, world_size: int = 2) -> None:
        body = {"step": step, "samples_per_s": 100.0, "loss": 1.0, "world_size": world_size}
        self.http.post("/progress", json=body).raise_for_status()

    def recovery(self, phase: str, lost: str, *, failed_at: float, **fields: Any) -> None:
        """rank 0 of the repaired generation: ``started`` right after it formed, ``done`` after
        its first committed step."""
        self.event(
            "recovery", phase=phase, incident=f"{self.job_id}/g1", recovery_kind="peer", lost=[lost],
            lost_ranks=[1], failed_at=failed_at, detected_at=failed_at + 0.01, formed_at=failed_at + 0.04,
            step=12, world_before=2, world_after=2, **fields,
        )  # fmt: skip


def submit(svc: ServiceProcess, **spec: Any) -> str:
    with svc.client() as client:
        answer = client.post("/v1/jobs", json=job_spec("peer", "2", max_restarts=2) | spec)
        assert answer.status_code == 201, answer.text
        job_id: str = answer.json()["id"]
    wait_for(lambda: job(svc, job_id)["state"] == "RUNNING", what="the job RUNNING")
    return job_id


def job(svc: ServiceProcess, job_id: str) -> dict[str, Any]:
    with svc.client() as client:
        record: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").json()
    return record


def nodes(svc: ServiceProcess, job_id: str, role: str) -> dict[int, str]:
    live = ("launching", "running")
    return {
        n["index"]: n["launch_id"]
        for n in job(svc, job_id)["nodes"]
        if n["role"] == role and n["phase"] in live
    }


def phase(svc: ServiceProcess, job_id: str, launch_id: str) -> str | None:
    return next((n["phase"] for n in job(svc, job_id)["nodes"] if n["launch_id"] == launch_id), None)


def kinds(svc: ServiceProcess) -> dict[str, float]:
    """The recovery metrics by kind, as a scrape shows them."""
    return {
        "peer": svc.metric("elastrain_job_recovery_seconds_count", kind="peer"),
        "restart": svc.metric("elastrain_job_recovery_seconds_count", kind="restart"),
        "transfer": svc.metric("elastrain_job_recovery_phase_seconds_count", phase="transfer", kind="peer"),
        "peer_bytes": svc.metric("elastrain_job_recovery_bytes_total", source="peers"),
        "voided": svc.metric("elastrain_job_voided_windows_total"),
    }


def grew(before: dict[str, float], svc: ServiceProcess, **by: float) -> bool:
    after = kinds(svc)
    return all(after[k] - before[k] == by.get(k, 0) for k in after)


def desired(svc: ServiceProcess, job_id: str) -> dict[str, int] | None:
    found = EtcdStore([svc.etcd]).get(keys.group_desired(job_id))
    return None if found is None else json.loads(found.value)


def peer_job(svc: ServiceProcess) -> tuple[str, Workers]:
    job_id = submit(svc, recovery={"mode": "peer"}, spares=1)
    workers = Workers(svc, job_id)
    workers.event("group_formed", group_id="g0", world_size=2, restart_count=0)
    workers.progress(12)
    return job_id, workers


def check_one_peer_recovery(svc: ServiceProcess, job_id: str, *, failed_at: float) -> None:
    record = job(svc, job_id)
    assert record["state"] == "RUNNING" and record["restarts"] == 0, record["events"][-8:]
    (recovery,) = record["recoveries"]
    assert (recovery["kind"], recovery["incident"], recovery["lost"]) == (
        "peer",
        f"{job_id}/g1",
        [f"{job_id}-n1-a0"],
    )
    assert recovery["failed_at"] == failed_at and recovery["steps_lost"] == 0
    assert recovery["seconds"] == pytest.approx(0.15)
    assert [p["name"] for p in recovery["phases"]] == ["detect", "reform", "transfer", "first_step"]
    assert (recovery["bytes_from_peers"], recovery["voided_windows"]) == (4_800_000, 1)
    promoted = recovery["lost"][0].replace("-n1-a0", "-n2-a0")
    wait_for(lambda: nodes(svc, job_id, "member") == {0: f"{job_id}-n0-a0", 1: promoted}, what="members")
    wait_for(lambda: len(nodes(svc, job_id, "spare")) == 1, what="a spare again")


def test_a_peer_job_launches_members_and_a_spare_and_tells_the_workers_its_size(svc: ServiceProcess) -> None:
    job_id = submit(svc, recovery={"mode": "peer"}, spares=1, nodes="1:3", initial_nodes=2)
    member, spare = svc.launch_env(f"{job_id}-n0-a0"), svc.launch_env(f"{job_id}-n3-a0")
    assert (member["ELASTRAIN_RECOVERY"], member["ELASTRAIN_ROLE"]) == ("peer", "member")
    assert (spare["ELASTRAIN_ROLE"], spare["ELASTRAIN_NODE_INDEX"]) == ("spare", "3")
    assert desired(svc, job_id) == {"nodes": 2, "spares": 1, "epoch": 1}
    with svc.client() as client:
        assert client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": 3}).status_code == 202
    assert desired(svc, job_id) == {"nodes": 3, "spares": 1, "epoch": 2}
    with svc.client() as client:
        assert client.delete(f"/v1/jobs/{job_id}").status_code == 202
    wait_for(lambda: desired(svc, job_id) is None, what="the desired key deleted with the job")


def test_workers_report_first_then_the_node_failure_is_one_peer_recovery(svc: ServiceProcess) -> None:
    job_id, workers = peer_job(svc)
    before = kinds(svc)
    lost_at = time.time()
    workers.recovery("started", f"{job_id}-n1-a0", failed_at=lost_at)
    assert job(svc, job_id)["state"] == "RECOVERING"
    workers.event("spare_promoted", launch_id=f"{job_id}-n2-a0", node_index=1)
    workers.recovery(
        "done", f"{job_id}-n1-a0", failed_at=lost_at, transferred_at=lost_at + 0.09,
        first_step_at=lost_at + 0.15, bytes_from_peers=4_800_000, voided_windows=1,
    )  # fmt: skip
    svc.set_status(f"{job_id}-n1-a0", "failed", 137, ended_at=lost_at - 0.01)
    wait_for(lambda: phase(svc, job_id, f"{job_id}-n1-a0") == "failed", what="the lost node seen")
    check_one_peer_recovery(svc, job_id, failed_at=lost_at)
    assert f"{job_id}-n2-a1" in svc.launches() and f"{job_id}-n1-a1" not in svc.launches()
    peer = {"peer": 1, "transfer": 1, "peer_bytes": 4_800_000, "voided": 1}
    wait_for(lambda: grew(before, svc, **peer), what="one peer recovery in the metrics")


def test_the_node_failure_first_then_the_workers_report_is_one_peer_recovery(svc: ServiceProcess) -> None:
    job_id, workers = peer_job(svc)
    before = kinds(svc)
    lost_at = time.time()
    svc.set_status(f"{job_id}-n1-a0", "failed", 137, ended_at=lost_at - 0.01)
    wait_for(lambda: job(svc, job_id)["state"] == "RECOVERING", what="a provisional incident")
    wait_for(lambda: f"{job_id}-n1-a1" in svc.launches(), what="a replacement in the slot")
    workers.recovery("started", f"{job_id}-n1-a0", failed_at=lost_at)
    workers.event("spare_promoted", launch_id=f"{job_id}-n2-a0", node_index=1)
    workers.recovery(
        "done", f"{job_id}-n1-a0", failed_at=lost_at, transferred_at=lost_at + 0.09,
        first_step_at=lost_at + 0.15, bytes_from_peers=4_800_000, voided_windows=1,
    )  # fmt: skip
    check_one_peer_recovery(svc, job_id, failed_at=lost_at)
    assert nodes(svc, job_id, "spare") == {2: f"{job_id}-n1-a1"}  # the replacement waits as the spare
    peer = {"peer": 1, "transfer": 1, "peer_bytes": 4_800_000, "voided": 1}
    wait_for(lambda: grew(before, svc, **peer), what="one peer recovery in the metrics")


@pytest.mark.parametrize("node_first", [True, False], ids=["node-then-group", "group-then-node"])
def test_restart_mode_a_lost_agent_and_the_reformation_are_one_recovery(
    svc: ServiceProcess, node_first: bool
) -> None:
    """Node 1's agent ends (its scheduler records when); the survivors' group
    re-forms with a replacement and steps. One recovery, timed from the node's end, one restart."""
    job_id = submit(svc, recovery={"mode": "restart"})
    before = kinds(svc)
    workers = Workers(svc, job_id)
    workers.event("group_formed", group_id="g0", world_size=2, restart_count=0)
    workers.progress(12)
    ended_at = time.time()

    def lose_node() -> None:
        svc.set_status(f"{job_id}-n1-a0", "failed", 137, ended_at=ended_at)
        wait_for(lambda: f"{job_id}-n1-a1" in svc.launches(), what="the replacement")

    def reform() -> None:
        workers.event("group_formed", group_id="g1", world_size=2, restart_count=1)

    for step in (lose_node, reform) if node_first else (reform, lose_node):
        step()
        assert job(svc, job_id)["state"] == "RECOVERING"
    workers.event("state_loaded", step=10)
    workers.event("first_step", step=11)
    wait_for(lambda: job(svc, job_id)["state"] == "RUNNING", what="RUNNING again")
    record = job(svc, job_id)
    (recovery,) = record["recoveries"]
    assert (recovery["kind"], recovery["lost"], record["restarts"]) == ("restart", [f"{job_id}-n1-a0"], 1)
    assert recovery["failed_at"] == ended_at and recovery["steps_lost"] == 2
    assert recovery["seconds"] == pytest.approx(recovery["first_step_at"] - ended_at)
    assert recovery["phases"][-1]["name"] == "first_step"
    wait_for(lambda: grew(before, svc, restart=1), what="one restart recovery in the metrics")
