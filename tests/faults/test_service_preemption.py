"""A SIGTERM to a node's first process under the service is a preemption (fault row
``service-preempt``): the real ``elastrain serve`` with its local scheduler, a 2-node job (one process
each), and at a seeded step a SIGTERM, with ``os.kill``, to one node's wrapper or to both (the
whole job): what a kubelet sends a pod's first process. Restart mode: the workers stop at one step
and save it, the service records one incident of kind ``preemption`` that uses no restart,
relaunches the node(s) at once, and the job resumes at the saved step (0 steps lost) and ends
digest-equal to the same job on two bare one-process torchrun nodes (each process with the one
compute thread the service gives a worker here: ``OMP_NUM_THREADS=1``, which the service decides
from the host's cores and its slots and which the run record states). Peer mode: see its test.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.ports import free_port
from tests.integration.launch import REPO, worker_env, write_spec
from tests.integration.worker.test_service_e2e import Service, digest, job_spec, until
from tests.seeds import seeded, swept
from tests.shared_runs import once

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 200
SPEC = {"nodes": "2", "nproc_per_node": 1, "max_steps": STEPS, "recovery": {"mode": "restart"}}


@pytest.fixture(scope="session")
def two_node_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The job on two bare one-process torchrun nodes: the digest it must end with."""

    def reference(tmp: Path) -> str:
        body = job_spec(max_steps=STEPS) | {"checkpoint": {"dir": str(tmp / "ck"), "interval_steps": 10}}
        path = write_spec(tmp, body)
        port = free_port()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=reference",
               "-m", "worker", "--config", str(path)]  # fmt: skip
        env = worker_env({"OMP_NUM_THREADS": "1"})
        nodes = [subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
        for node in nodes:
            _, err = node.communicate(timeout=600)
            assert node.returncode == 0, err[-3000:]
        return digest(tmp / "ck")

    return str(once(tmp_path_factory, "faults-preempt-2x1", reference))


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    # PYTHONPATH: the service and the nodes it starts run the tree under test
    svc = Service(tmp_path / "svc", {"PYTHONPATH": str(REPO)})
    svc.data_dir.mkdir()
    svc.start()
    yield svc
    svc.stop()


def wrapper_pids(svc: Service, job_id: str) -> list[int]:
    """The first process of each of the job's running nodes (the local scheduler's node wrapper)."""
    pids = []
    for node in sorted((svc.data_dir / "nodes" / job_id).glob("*/node.json")):
        if not (node.parent / "exit.json").exists():
            pids.append(int(json.loads(node.read_text())["pid"]))
    return pids


@seeded
@pytest.mark.parametrize("who", swept(["node", "job"]), ids=lambda w: w or "drawn")
def test_sigterm_to_nodes_is_a_preemption_that_loses_no_step(
    service: Service, two_node_digest: str, seed: int, who: str | None
) -> None:
    rng = random.Random(seed)
    who = who or rng.choice(["node", "job"])
    at = rng.randrange(20, 120)
    job_id = service.submit(job_spec(**SPEC))
    until(lambda: (service.job(job_id)["step"] or 0) >= at, f"step {at}", 300)
    pids = wrapper_pids(service, job_id)
    assert len(pids) == 2, pids  # the two nodes' wrappers
    targets = pids if who == "job" else [pids[rng.randrange(2)]]
    what = f"seed={seed} SIGTERM to {len(targets)} node(s) at step {at}"
    for pid in targets:
        os.kill(pid, signal.SIGTERM)
    final = service.finished(job_id)
    assert final["state"] == "SUCCEEDED", f"{what}: {final['reason']}\n{service.node_logs(job_id)[-3000:]}"
    assert final["restarts"] == 0 and final["preemptions"] == 1, f"{what}: {final['recoveries']}"
    (recovery,) = final["recoveries"]
    assert recovery["kind"] == "preemption" and not recovery["charged"], f"{what}: {recovery}"
    assert recovery["step_before"] >= at and recovery["steps_lost"] == 0, f"{what}: {recovery}"
    assert digest(Path(final["checkpoint_dir"])) == two_node_digest, what


@seeded
@pytest.mark.parametrize("who", swept(["node", "job"]), ids=lambda w: w or "drawn")
def test_in_peer_mode_a_preempted_node_hands_off_and_a_preempted_job_saves(
    service: Service, two_node_digest: str, seed: int, who: str | None
) -> None:
    """Peer mode: the signalled node's rank leaves at a step boundary without a save and the
    other keeps its state in memory and goes on (no restart); the whole job signalled saves
    and resumes from that step."""
    rng = random.Random(seed)
    who = who or rng.choice(["node", "job"])
    at = rng.randrange(20, 120)
    job_id = service.submit(job_spec(**(SPEC | {"recovery": {"mode": "peer"}})))
    until(lambda: (service.job(job_id)["step"] or 0) >= at, f"step {at}", 300)
    pids = wrapper_pids(service, job_id)
    assert len(pids) == 2, pids  # the two nodes' wrappers
    targets = pids if who == "job" else [pids[rng.randrange(2)]]
    what = f"seed={seed} peer mode: SIGTERM to {len(targets)} node(s) at step {at}"
    for pid in targets:
        os.kill(pid, signal.SIGTERM)
    final = service.finished(job_id)
    assert final["state"] == "SUCCEEDED", f"{what}: {final['reason']}\n{service.node_logs(job_id)[-3000:]}"
    assert final["restarts"] == 0, f"{what}: {final['recoveries']}"
    assert all(r["steps_lost"] in (0, None) for r in final["recoveries"]), f"{what}: {final['recoveries']}"
    # whichever node it was, the incident is a preemption (the leaving rank says so itself)
    kinds = [(r["kind"], r["charged"]) for r in final["recoveries"]]
    assert ("preemption", False) in kinds and final["preemptions"] >= 1, f"{what}: {final['recoveries']}"
    assert digest(Path(final["checkpoint_dir"])) == two_node_digest, what
