"""Control-plane rows: ``kill -9`` of the service (real uvicorn + etcd, the file-backed fake
scheduler of tests/integration/service) in the middle of a submit and of a scale, then a
restart on the same etcd and data dir.

The fake scheduler keeps these rows fast and lets them count launches exactly: what they prove is
the control plane's bookkeeping across a kill (one job per key, each node launched once). The
same kills with the real scheduler, the real ``elastrain serve`` and real torchrun workers are in
``test_real_service.py``.

Where the kill lands, and how the row knows it did: during a submit, eight clients keep posting
the same Idempotency-Key until the service dies, and at least one request must have been cut
in flight (sent, never answered); during a scale, either at the failpoint between the scale's
read and its fenced write (``service_before_scale_write=kill``, its marker in the service's log)
or right after the service answered 202 (the write is in etcd, the launch may not be).

Invariants: one Idempotency-Key gives one job however the kill lands (every answer names the
same id, the job is launched once per node); after a scale the state converges to the asked
size, each node is launched once, and the node that was already training is neither cancelled
nor relaunched (a control-plane restart does not interrupt training).
"""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from svc_process import ServiceProcess, job_spec, wait_for

from service.etcd.server import EtcdServer
from tests.seeds import seeded

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


CUT, REFUSED = -1, -2  # the kill cut a request in flight; a request found the service gone


def post(
    svc: ServiceProcess, spec: dict[str, Any], key: str, client: httpx.Client | None = None
) -> tuple[int, str | None]:
    headers = {"Authorization": f"Bearer {svc.token}", "Idempotency-Key": key}
    try:
        resp = (client or httpx).post(f"{svc.url}/v1/jobs", json=spec, headers=headers, timeout=10)
    except httpx.ConnectError:
        return REFUSED, None
    except httpx.HTTPError:
        return CUT, None  # sent, and the connection died before the answer
    return resp.status_code, resp.json().get("id") if resp.status_code < 300 else None


def post_until_refused(
    svc: ServiceProcess, spec: dict[str, Any], key: str, answered: threading.Event
) -> list[tuple[int, str | None]]:
    """One client: submit again and again until the service is gone; ``answered`` is set at the
    first answer. A new connection for each request (no keep-alive), so a request that finds the
    service gone is refused, and only one sent before the kill can be cut."""
    answers: list[tuple[int, str | None]] = []
    with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while not answers or answers[-1][0] not in (CUT, REFUSED):
            answers.append(post(svc, spec, key, client))
            answered.set()
    return answers


def kill_while_submitting(svc: ServiceProcess, spec: dict[str, Any], key: str, delay: float) -> list[Any]:
    """Eight clients submit under one key; ``delay`` seconds after the first answer, kill -9."""
    answered = threading.Event()
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(post_until_refused, svc, spec, key, answered) for _ in range(8)]
        assert answered.wait(60), "no submission was answered"
        time.sleep(delay)  # where in the stream of submissions the kill lands (seeded)
        svc.kill9()
        return [answer for f in futures for answer in f.result()]


@seeded
def test_kill9_during_submit_with_idempotency_key(svc: ServiceProcess, seed: int) -> None:
    rng = random.Random(seed)
    spec, key = SPEC | {"name": f"idem-{seed}"}, f"key-{seed}"
    delay = rng.uniform(0.0, 0.4)
    before = kill_while_submitting(svc, spec, key, delay)
    svc.start()
    status, job_id = post(svc, spec, key)
    what = f"seed={seed} delay={delay:.2f}s answers={sorted(set(before), key=str)}"
    assert CUT in [s for s, _ in before], f"{what}: the kill cut no submission in flight"
    assert status in (200, 201) and job_id, what
    assert {i for s, i in before if i is not None} <= {job_id}, what
    assert all(s in (CUT, REFUSED, 200, 201) for s, _ in before), what
    with svc.client() as client:
        jobs = client.get("/v1/jobs", params={"limit": 500}).json()["jobs"]
        assert [j["name"] for j in jobs].count(spec["name"]) == 1, what
        wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json()["state"] == "RUNNING", what="RUNNING")
    launched = [x for x in svc.launches() if x.startswith(job_id)]
    assert sorted(launched) == [f"{job_id}-n{i}-a0" for i in range(3)], what


def scale(svc: ServiceProcess, job_id: str, nodes: int) -> int:
    headers = {"Authorization": f"Bearer {svc.token}"}
    try:
        return httpx.post(
            f"{svc.url}/v1/jobs/{job_id}/scale", json={"nodes": nodes}, headers=headers, timeout=30
        ).status_code
    except httpx.HTTPError:
        return CUT


@seeded
def test_kill9_during_scale_converges(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    target, where = rng.choice([2, 3]), rng.choice(["before the write", "after the write"])
    what = f"seed={seed} target={target} kill {where}"
    armed = (
        {"ELASTRAIN_FAILPOINTS": "service_before_scale_write=kill#1"} if where == "before the write" else {}
    )
    with EtcdServer(tmp_path / "etcd") as etcd:
        svc = ServiceProcess(tmp_path, etcd=etcd.endpoint, env=armed).start()
        try:
            with svc.client() as client:
                job_id = client.post("/v1/jobs", json=SPEC | {"initial_nodes": 1}).json()["id"]
                wait_for(
                    lambda: client.get(f"/v1/jobs/{job_id}").json()["state"] == "RUNNING", what="RUNNING"
                )
            first = f"{job_id}-n0-a0"
            assert svc.launches() == [first]
            answered = scale(svc, job_id, target)
            assert svc.proc is not None
            if where == "before the write":
                assert answered == CUT and svc.proc.wait(timeout=30) == -signal.SIGKILL, what
                marker = f"elastrain failpoint service_before_scale_write: kill (pid {svc.proc.pid})"
                assert marker in svc.log_tail(), f"{what}: the service did not die inside the scale"
            else:
                assert answered == 202, f"{what}: {answered}"  # the write is in etcd
                svc.kill9()
            svc.extra_env = {}  # started again as an operator would: without the failpoint
            svc.start()
            with svc.client() as client:
                assert client.post(f"/v1/jobs/{job_id}/scale", json={"nodes": target}).status_code == 202, (
                    what
                )
                want = sorted(f"{job_id}-n{i}-a0" for i in range(target))
                wait_for(lambda: sorted(svc.launches()) == want, timeout_s=60, what=f"{target} nodes; {what}")
                got = client.get(f"/v1/jobs/{job_id}").json()
        finally:
            svc.stop()
    assert [n["phase"] for n in got["nodes"]].count("running") == target, f"{what}: {got['nodes']}"
    cancels = svc.nodes_dir / "cancels.log"
    assert first not in (cancels.read_text() if cancels.exists() else ""), f"{what}: node 0 was cancelled"
    assert sorted(svc.launches()) == want, f"{what}: {svc.launches()}"
