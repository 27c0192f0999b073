"""The control-plane rows whose promise is about launching and recovering, with every part real:
the ``elastrain`` console script (``elastrain serve``), the local TorchX scheduler (``local_cwd``:
each launch is a node directory and a torchrun agent), real torchrun workers on CPU/gloo; two
service replicas on one etcd for the fencing row, a real 3-member etcd cluster for the quorum row.

``test_service_faults.py``, ``test_leader_fencing.py`` and ``test_etcd_quorum.py`` run the same
faults on the file-backed fake scheduler: fast enough for many seeded trials and exact about
launches, but nothing runs there. Here a launch is a process that must form a group and train,
and "launched once" is counted from the node directories the scheduler made (across both
replicas' data directories in the fencing row).

The job (one process per node, a small MLP) is slowed to ~0.05 s a step: the rows act on it
while it trains (a scale, a node kill, a pause), and each of those takes seconds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.demo import alive
from service.etcd.server import EtcdServer
from tests.faults.etcd_cluster import EtcdCluster
from tests.faults.test_service_faults import CUT, kill_while_submitting, post, scale
from tests.integration.worker.test_service_e2e import Service, until
from tests.seeds import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
SLOW = "after_grad_sync=sleep:0.05"
SPEC: dict[str, Any] = {
    "name": "real",
    "model": {"name": "mlp", "kwargs": {"hidden": 16}},
    "data": {"name": "synthetic", "samples": 1024},
    "micro_batch_size": 8,
    "max_steps": 2000,  # never reached: each row cancels the job once it has what it checks
    "nodes": "1:2",
    "initial_nodes": 1,
    "nproc_per_node": 1,
    "max_restarts": 3,
}
REFUSED_WRITES = "elastrain_fenced_writes_refused_total"


def training(svc: Service, job_id: str, *, world: int) -> bool:
    """The job runs at world size ``world`` and its workers report steps."""
    job = svc.job(job_id)
    return job["state"] == "RUNNING" and job["world_size"] == world and (job["step"] or 0) >= 1


def agent_pid(node_dir: Path) -> int:
    """The torchrun agent of a node: the child the node wrapper recorded (``node.json``)."""
    return int(json.loads((node_dir / "node.json").read_text())["child_pid"])


def cancel(svc: Service, job_id: str) -> None:
    svc.http.delete(f"/v1/jobs/{job_id}")
    until(lambda: svc.job(job_id)["state"] == "CANCELLED", "the job to be cancelled", 120)


@seeded
def test_real_kill9_during_submit_and_during_scale(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    delay = rng.uniform(0.0, 0.4)
    what = f"seed={seed} delay={delay:.2f}s"
    key = f"real-{seed}"
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": SLOW})
    svc.data_dir.mkdir()
    svc.start()
    job_id = ""
    try:
        # kill -9 while eight clients submit under one Idempotency-Key
        before = kill_while_submitting(svc, SPEC, key, delay)
        assert CUT in [s for s, _ in before], f"{what}: the kill cut no submission in flight"
        # started again, armed to die inside the next scale (read done, fenced write pending)
        svc.env = {"ELASTRAIN_FAILPOINTS": f"{SLOW},service_before_scale_write=kill#1"}
        svc.start()
        status, job_id = post(svc, SPEC, key)
        assert status in (200, 201) and job_id, f"{what}: {status}"
        assert {i for _, i in before if i is not None} <= {job_id}, what
        assert [j["name"] for j in svc.http.get("/v1/jobs").json()["jobs"]].count("real") == 1, what
        until(lambda: training(svc, job_id, world=1), f"the job to train; {what}", 180)
        first = svc.data_dir / "nodes" / job_id / f"{job_id}-n0-a0"
        assert svc.launches(job_id) == [first.name], f"{what}: {svc.launches(job_id)}"
        agent = agent_pid(first)

        # kill -9 inside the scale
        assert scale(svc, job_id, 2) == CUT and svc.proc is not None
        assert svc.proc.wait(timeout=60) == -signal.SIGKILL, what
        marker = f"elastrain failpoint service_before_scale_write: kill (pid {svc.proc.pid})"
        assert marker in svc.log(), f"{what}: the service did not die inside the scale"
        svc.env = {"ELASTRAIN_FAILPOINTS": SLOW}
        svc.start()
        assert svc.http.post(f"/v1/jobs/{job_id}/scale", json={"nodes": 2}).status_code == 202, what
        until(lambda: training(svc, job_id, world=2), f"the job to train at world size 2; {what}", 240)
        launched = svc.launches(job_id)
        assert launched == [f"{job_id}-n0-a0", f"{job_id}-n1-a0"], f"{what}: launched {launched}"
        assert alive(agent) and not (first / "cancelled").exists(), f"{what}: node 0 was stopped"
    finally:
        if job_id and svc.proc is not None and svc.proc.poll() is None:
            cancel(svc, job_id)
        svc.stop()


def refused_writes(svc: Service) -> float:
    page = httpx.get(f"{svc.url}/metrics", timeout=10).text
    found = [
        s.value for f in text_string_to_metric_families(page) for s in f.samples if s.name == REFUSED_WRITES
    ]
    assert found, f"{REFUSED_WRITES} is not exported"
    return sum(found)


def leads(svc: Service) -> bool:
    try:
        return bool(svc.http.get("/readyz").json().get("leader"))
    except (httpx.HTTPError, ValueError):
        return False


def ready(svc: Service) -> int:
    try:
        return svc.http.get("/readyz").status_code
    except httpx.HTTPError:
        return -1


@seeded
def test_real_leader_fencing(tmp_path: Path, seed: int) -> None:
    pause = random.Random(seed).uniform(6.0, 10.0)
    what = f"seed={seed} pause {pause:.1f}s"
    with EtcdServer(tmp_path / "etcd") as etcd:
        common = {"ELASTRAIN_LEADER_TTL_S": "3"}
        held = {"ELASTRAIN_FAILPOINTS": f"{SLOW},service_before_scale_write=sleep:2#1"}
        a = Service(tmp_path / "a", common | held, etcd=etcd.endpoint)
        b = Service(
            tmp_path / "b", common | {"ELASTRAIN_FAILPOINTS": SLOW}, etcd=etcd.endpoint, token=a.token
        )
        for svc in (a, b):
            svc.data_dir.mkdir()
        a.start()
        until(lambda: leads(a), "a to lead", 60)
        b.start()
        job_id = ""
        try:
            job_id = a.submit(SPEC)
            until(lambda: training(a, job_id, world=1), f"the job to train; {what}", 180)
            first = a.data_dir / "nodes" / job_id / f"{job_id}-n0-a0"
            # the leader paused inside a scale (read done, fenced write pending), past its lease
            assert refused_writes(a) == 0
            answer: dict[str, Any] = {}

            def scale_on_a() -> None:
                answer["scale"] = a.http.post(f"/v1/jobs/{job_id}/scale", json={"nodes": 2}, timeout=120)

            writer = threading.Thread(target=scale_on_a)
            writer.start()
            until(lambda: "failpoint service_before_scale_write" in a.log(), f"the scale to hold; {what}", 60)
            assert a.proc is not None
            os.kill(a.proc.pid, signal.SIGSTOP)
            try:
                until(lambda: leads(b), f"b to take over; {what}", 60)
                for pid in worker_and_agent(agent_pid(first)):  # a real node failure, meanwhile
                    os.kill(pid, signal.SIGKILL)
                until(lambda: b.launches(job_id) == [f"{job_id}-n0-a1"], f"b relaunches node 0; {what}", 120)
                until(lambda: training(b, job_id, world=1), f"the relaunched node to train; {what}", 180)
                time.sleep(max(0.0, pause - 3))  # the rest of the pause (the fault's length)
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            writer.join(timeout=120)
            got = answer["scale"]
            assert got.status_code == 503 and "etcd refused" in got.text, (
                f"{what}: {got.status_code} {got.text}"
            )
            # the scale's write was refused (above); whatever else a had in flight when it woke (a
            # reconciler pass, a worker's report queued while it was stopped) is refused the same way
            assert refused_writes(a) >= 1, f"{what}: no stale write was refused"
            until(lambda: not leads(a), f"a steps down; {what}", 60)
            settled = refused_writes(a)
            time.sleep(3)  # a few reconciler intervals as a standby: it sends no write to be refused
            assert refused_writes(a) == settled, f"{what}: a kept writing after it stepped down"
            record = b.job(job_id)
            assert record["restarts"] == 1 and record["desired_nodes"] == 1, f"{what}: {record}"
            launched = a.launches(job_id) + b.launches(job_id)
            assert launched == [f"{job_id}-n0-a0", f"{job_id}-n0-a1"], f"{what}: launched {launched}"
            assert "lease lost" in a.log() or "lost leadership" in a.log(), f"{what}: a never noticed"
        finally:
            if job_id and b.proc is not None and b.proc.poll() is None:
                cancel(b, job_id)
            a.stop()
            b.stop()


CLOSED = "RendezvousClosedError"


@seeded
def test_real_etcd_quorum(tmp_path: Path, seed: int) -> None:
    first_lost, second_lost = random.Random(seed).sample(range(3), 2)
    what = f"seed={seed} lost m{first_lost} then m{second_lost}"
    with EtcdCluster(tmp_path / "etcd") as cluster:
        svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": SLOW}, etcd=cluster.endpoints)
        svc.data_dir.mkdir()
        svc.start()
        job_id = ""
        try:
            # one member lost: still serving, a job launches and trains
            cluster.kill_member(first_lost)
            until(lambda: ready(svc) == 200, f"ready with 2 of 3; {what}", 60)
            job_id = svc.submit(SPEC)
            until(lambda: training(svc, job_id, world=1), f"the job to train; {what}", 180)
            # two lost: not ready, nothing accepted, nothing launched
            cluster.kill_member(second_lost)
            until(lambda: ready(svc) == 503, f"/readyz 503 with 1 of 3; {what}", 60)
            refused = svc.http.post("/v1/jobs", json=SPEC | {"name": "no-quorum"}, timeout=30)
            assert refused.status_code == 503, f"{what}: {refused.status_code} {refused.text}"
            launched = svc.launches(job_id)
            time.sleep(2)  # a few reconciler passes without quorum
            assert svc.launches(job_id) == launched, f"{what}: launched without quorum"
            # members back: the service catches up and the job trains again
            cluster.start_member(first_lost)
            cluster.start_member(second_lost)
            cluster.wait_healthy([0, 1, 2])
            until(lambda: ready(svc) == 200, f"ready again; {what}", 60)

            def back() -> bool:
                assert CLOSED not in svc.node_logs(job_id), (
                    f"{what}: a relaunched node found the rendezvous closed"
                )
                return training(svc, job_id, world=1)

            until(back, f"the job to train again; {what}", 180)
            caught_up = svc.submit(SPEC | {"name": "caught-up"})
            until(lambda: svc.launches(caught_up) == [f"{caught_up}-n0-a0"], f"a new launch; {what}", 60)
            cancel(svc, caught_up)
        finally:
            if job_id and svc.proc is not None and svc.proc.poll() is None:
                cancel(svc, job_id)
            svc.stop()


def worker_and_agent(agent: int) -> list[int]:
    """A torchrun agent and its worker processes (a lost machine: all die at once)."""
    children = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
    return [agent, *(int(c) for c in children)]
