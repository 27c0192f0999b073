"""``kill -9`` of the service while it publishes a checkpoint (real service, embedded etcd, real
torchrun workers). The service's own coordinator runs worker.checkpoint.publish, so a failpoint
armed in the service's environment (``NAME=sleep:6#NTH``, no ``@RANK``: workers under the
service never publish) holds it inside the durable step; the test kills it there and restarts.

Invariants: the job succeeds without a worker restart (training was not interrupted), every
checkpoint is published once (registry steps unique, one manifest per step, no staging left,
the directory verifies), and the final digest equals an uninterrupted bare torchrun run's.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from service.cli import main as elastrain
from tests.faults.conftest import seeded
from tests.integration.launch import run_worker, write_spec
from tests.integration.worker.test_service_e2e import Service, digest, job_spec, until

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 30
POINTS = ["before_publish_rename", "after_publish_rename", "before_latest_update"]


@pytest.fixture(scope="module")
def bare30(tmp_path_factory: pytest.TempPathFactory) -> str:
    tmp = tmp_path_factory.mktemp("bare30")
    spec = job_spec(max_steps=STEPS) | {"checkpoint": {"dir": str(tmp / "ck"), "interval_steps": 10}}
    bare = {k: v for k, v in spec.items() if k not in ("nodes", "nproc_per_node", "max_restarts")}
    run = run_worker(write_spec(tmp, bare), nproc=2)
    assert run.code == 0, run.stderr[-3000:]
    return digest(tmp / "ck")


def service_log(svc: Service) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(svc.data_dir.glob("service-*.log")))


@seeded
def test_kill9_of_the_service_during_publish(tmp_path: Path, bare30: str, seed: int) -> None:
    rng = random.Random(seed)
    point, nth = rng.choice(POINTS), rng.choice([1, 2])
    arm = f"{point}=sleep:6#{nth}"
    what = f"seed={seed} {arm}"
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": f"after_grad_sync=sleep:0.05,{arm}"})
    svc.data_dir.mkdir()
    svc.start()
    try:
        job_id = svc.submit(job_spec(max_steps=STEPS))
        until(
            lambda: f"elastrain failpoint {point}" in service_log(svc), f"the service at {point}; {what}", 200
        )
        time.sleep(rng.uniform(0.2, 3.0))
        svc.kill9()
        svc.start()
        final = svc.finished(job_id, timeout=150)
        listed = [c["step"] for c in svc.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]]
    finally:
        svc.stop()
    assert final["state"] == "SUCCEEDED", f"{what}: {final}"
    assert final["restarts"] == 0 and all(n["attempt"] == 0 for n in final["nodes"]), (
        f"{what}: {final['nodes']}"
    )
    ck = Path(final["checkpoint_dir"])
    steps = [json.loads(m.read_text())["step"] for m in sorted(ck.glob("step-*/manifest.json"))]
    assert len(steps) == len(set(steps)) and STEPS in steps, f"{what}: manifests {steps}"
    assert len(listed) == len(set(listed)) and listed[-1] == STEPS, f"{what}: registry {listed}"
    assert not list(ck.glob(".staging-*")), f"{what}: staging left behind"
    assert elastrain(["checkpoint", "verify", str(ck)]) == 0, what
    assert digest(ck) == bare30, what
