"""``kill -9`` of the service while it publishes a checkpoint (the ``elastrain serve`` console
script, embedded etcd, the local TorchX scheduler, real torchrun workers at their real step rate).
The service's own coordinator runs worker.checkpoint.publish, so a failpoint armed in the
service's environment (``NAME=kill#NTH``, no ``@RANK``: workers under the service never
publish) SIGKILLs the service inside the durable step, at exactly that place; its marker in the
service's log proves it. The service is then started again without the failpoint.

Invariants: the job succeeds without a worker restart (training was not interrupted), every
checkpoint is published once (registry steps unique, one manifest per step, no staging left,
the directory verifies), and the final digest equals an uninterrupted bare torchrun run's.
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

import pytest

from service.cli import main as elastrain
from tests.integration.worker.test_service_e2e import Service, digest, job_spec
from tests.seeds import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 30
POINTS = ["before_publish_rename", "after_publish_rename", "before_latest_update"]


def svc_manifests(svc: Service, job_id: str) -> list[Path]:
    return sorted(Path(svc.job_dir(job_id)).glob("step-*/manifest.json"))


@seeded
def test_kill9_of_the_service_during_publish(tmp_path: Path, service_job_digest: str, seed: int) -> None:
    rng = random.Random(seed)
    point, nth = rng.choice(POINTS), rng.choice([1, 2])
    arm = f"{point}=kill#{nth}"
    what = f"seed={seed} {arm}"
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": arm})
    svc.data_dir.mkdir()
    svc.start()
    try:
        job_id = svc.submit(job_spec(max_steps=STEPS))
        assert svc.proc is not None
        code = svc.proc.wait(timeout=300)  # the failpoint kills it; nothing else stops it
        assert code == -signal.SIGKILL, f"{what}: the service exited with {code}:\n{svc.log()[-3000:]}"
        marker = f"elastrain failpoint {point}: kill (pid {svc.proc.pid})"
        assert marker in svc.log(), f"{what}: the service did not die inside the publish"
        published = sorted(int(m.parent.name[5:]) for m in svc_manifests(svc, job_id))
        assert published == [10 * n for n in range(1, nth + int(point != POINTS[0]))], f"{what}: {published}"
        svc.env = {}  # started again as an operator would: without the failpoint
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
    assert digest(ck) == service_job_digest, what
