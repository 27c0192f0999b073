"""SIGSTOP the service leader past its lease, then SIGCONT (two real services on one etcd,
sharing the file-backed fake scheduler; leader_ttl_s=3): the standby takes over and recovers a
failed node once; the woken old leader's stale writes are refused by the fencing check -- it
steps down, nothing is launched twice and the restart is counted once.

The leader is stopped in the middle of a write: a scale request has read the job and taken the
leader fence (failpoint ``service_before_scale_write`` holds it there), then SIGSTOP. After
SIGCONT that request's write reaches etcd with the stale fence, and etcd's transaction refuses
it: the client gets 503, the job keeps the new leader's state, and the old leader's
``elastrain_fenced_writes_refused_total`` counts it (read through a scrape of its /metrics).

The fake scheduler keeps the row fast (many seeded trials in ``make faults``) and lets the test
fail a node by writing its status; ``test_real_service.py::test_real_leader_fencing`` runs the
same fault once with real replicas, the real scheduler and a real job whose node really dies."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from svc_process import ServiceProcess, job_spec, wait_for

from service.etcd.server import EtcdServer
from tests.seeds import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
# The restart path on purpose: the failed node is counted as one restart by whichever leader acts.
SPEC: dict[str, Any] = job_spec("fence", "1:2", initial_nodes=1, max_restarts=3, recovery={"mode": "restart"})
REFUSED = "elastrain_fenced_writes_refused_total"


def leader(svc: ServiceProcess) -> bool:
    try:
        return bool(httpx.get(f"{svc.url}/readyz", timeout=5).json().get("leader"))
    except (httpx.HTTPError, ValueError):
        return False


def post_scale(svc: ServiceProcess, job_id: str) -> tuple[int, str]:
    with svc.client() as client:
        answer = client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": 2}, timeout=120)
    return answer.status_code, answer.text


@seeded
def test_sigstop_leader_past_lease_is_fenced(tmp_path: Path, seed: int) -> None:
    pause = random.Random(seed).uniform(6.0, 10.0)
    what = f"seed={seed} pause={pause:.1f}s"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with EtcdServer(tmp_path / "etcd") as etcd:
        # sleep: long enough to SIGSTOP it inside, shorter than the pause (time runs on while stopped)
        a = ServiceProcess(
            tmp_path / "a",
            etcd=etcd.endpoint,
            env={"ELASTRAIN_FAILPOINTS": "service_before_scale_write=sleep:2#1"},
        ).start()
        b = ServiceProcess(tmp_path / "b", etcd=etcd.endpoint)
        b.nodes_dir = a.nodes_dir
        b.start()
        try:
            wait_for(lambda: leader(a) and not leader(b), timeout_s=30, what=f"a leads; {what}")
            with a.client() as client:
                job_id = client.post("/v1/jobs", json=SPEC).json()["id"]
                wait_for(
                    lambda: client.get(f"/v1/jobs/{job_id}").json()["state"] == "RUNNING", what="RUNNING"
                )
            assert a.proc is not None and a.metric(REFUSED) == 0
            scale: dict[str, Any] = {}
            writer = threading.Thread(target=lambda: scale.update(answer=post_scale(a, job_id)))
            writer.start()
            wait_for(lambda: "failpoint service_before_scale_write" in a.log_tail(), what="scale holds")
            os.kill(a.proc.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: leader(b), timeout_s=30, what=f"b takes over; {what}")
                a.set_status(f"{job_id}-n0-a0", "failed", 137)
                wait_for(
                    lambda: f"{job_id}-n0-a1" in a.launches(), timeout_s=30, what=f"b relaunches; {what}"
                )
                time.sleep(max(0.0, pause - 3))
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)
            writer.join(timeout=60)
            status, body = scale["answer"]
            assert status == 503 and "etcd refused" in body, f"{what}: the stale write got {status} {body}"
            assert a.metric(REFUSED) == 1, f"{what}: the one stale write, refused once"
            wait_for(lambda: not leader(a), timeout_s=30, what=f"a steps down; {what}")
            with b.client() as client:
                got = client.get(f"/v1/jobs/{job_id}").json()
        finally:
            a.stop()
            b.stop()
    launched = a.launches()
    assert sorted(launched) == [f"{job_id}-n0-a0", f"{job_id}-n0-a1"], f"{what}: {launched}"
    assert got["restarts"] == 1, f"{what}: {got}"
    assert got["desired_nodes"] == 1, f"{what}: the refused scale changed the job: {got}"
    log = (tmp_path / "a" / "service.log").read_text()
    assert "lease lost" in log or "lost leadership" in log, f"{what}: the old leader never noticed"
