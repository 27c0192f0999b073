"""A straggler replaced by a warm spare (``stragglers.action: replace``), the slowness made from
outside the worker: the real ``elastrain serve`` with its local scheduler, a peer-mode job of 2
one-process nodes and 1 warm spare; one member's worker is stopped and continued in a duty cycle
(SIGSTOP 50 ms, SIGCONT 5 ms, as in the straggler row) from the job's 10th step until the group
names it. Its node leaves at a step boundary, the spare takes its slot from the survivor's memory
(no checkpoint read, no restart), the survivor keeps its process, and the job ends digest-equal
to the same training on a bare torchrun.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.demo import alive, worker_pids
from tests.faults.duty import stop_cycles
from tests.integration.launch import REPO, run_worker, write_spec
from tests.integration.worker.test_service_e2e import Service, digest, job_spec, until
from tests.seeds import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 150  # room for the 2 slow windows, a spare still starting up and the leave


def spec(**over: Any) -> dict[str, Any]:
    """The straggler row's model (a step computes over several stop periods) on 2 nodes. The
    threshold is 2x: the duty cycle slows the victim about tenfold, and the service's processes
    share this machine's cores with the job (a rank named by noise would be replaced too). A save
    every 30 steps keeps the record's last events those of the straggler."""
    return job_spec(
        nodes="2", nproc_per_node=1, max_steps=STEPS, recovery={"mode": "peer"}, spares=1,
        model={"name": "mlp", "kwargs": {"hidden": 512, "depth": 4}},
        data={"name": "synthetic", "samples": 8192, "kwargs": {"input_dim": 128}},
        micro_batch_size=32, checkpoint={"interval_steps": 30, "retention": {"keep_latest": 50}},
        stragglers={"window_steps": 10, "windows": 2, "slowdown": 2.0, "action": "replace"},
    ) | over  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final checkpoint digest of the same training on a bare torchrun (2 processes)."""
    tmp = tmp_path_factory.mktemp("bare-replace")
    body = spec(nodes="1", nproc_per_node=2, recovery={"mode": "restart"}, spares=0, stragglers={})
    body["checkpoint"] = body["checkpoint"] | {"dir": str(tmp / "ck")}
    run = run_worker(write_spec(tmp, body), nproc=2)
    assert run.code == 0, run.stderr[-3000:]
    return digest(tmp / "ck")


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = Service(tmp_path / "svc", {"PYTHONPATH": str(REPO)})  # the nodes run the tree under test
    svc.data_dir.mkdir()
    svc.start()
    yield svc
    svc.stop()


def kinds(job: dict[str, Any]) -> list[str]:
    return [e["kind"] for e in job["events"]]


def duty_cycle(service: Service, job_id: str, pid: int) -> str:
    """Stop and continue ``pid`` until the job's events say the straggler is replaced (a straggler
    kept for want of a spare leaves once one waits), or the process is gone; it is left running.
    Says how many cycles ran."""
    asked = [0.0]

    def done() -> bool:
        if not alive(pid):
            return True
        if time.monotonic() - asked[0] <= 0.5:  # the service's record, twice a second
            return False
        asked[0] = time.monotonic()
        return "straggler_replaced" in kinds(service.job(job_id))

    return stop_cycles(pid, done)


@seeded
def test_a_straggler_leaves_and_the_spare_takes_its_place(
    service: Service, uninterrupted: str, seed: int
) -> None:
    node = random.Random(seed).randrange(2)
    job_id = service.submit(spec())
    victim, survivor = f"{job_id}-n{node}-a0", f"{job_id}-n{1 - node}-a0"
    until(lambda: (service.job(job_id)["step"] or 0) >= 10, "the job 10 steps in", 300)
    (victim_pid,) = until(lambda: worker_pids(launch_id=victim), "the victim's worker", 30)
    (survivor_pid,) = until(lambda: worker_pids(launch_id=survivor), "the survivor's worker", 30)
    # Slowed from here on: a spare still starting up on a loaded machine cannot be outrun (the
    # group keeps its straggler until the spare stands by, then replaces it).
    cycled = duty_cycle(service, job_id, victim_pid)
    what = f"seed={seed} victim node {node}, {cycled}"
    repaired = lambda: (r := service.job(job_id)["recoveries"]) and r[0]["first_step_at"]  # noqa: E731
    try:
        until(repaired, f"{what}: the repaired group's first step", 120)
    except AssertionError as exc:  # say what the group measured
        windows = [ln for ln in service.node_output(job_id, victim).splitlines() if "straggler" in ln]
        raise AssertionError(f"{exc}; the victim's straggler lines: {windows[-6:]}") from None
    assert not alive(victim_pid), f"{what}: the straggler's worker still runs after the group was repaired"
    os.kill(survivor_pid, 0)  # the survivor kept its process (raises if it is gone)
    final = service.finished(job_id)
    assert final["state"] == "SUCCEEDED", (what, final["events"][-12:], service.node_logs(job_id)[-4000:])
    events = kinds(final)
    assert {"straggler", "straggler_replaced", "straggler_left"} <= set(events), (what, final["events"][-20:])
    (replaced,) = [e["message"] for e in final["events"] if e["kind"] == "straggler_replaced"]
    assert f" on node {node} (" in replaced, (what, replaced)
    (recovery,) = final["recoveries"]
    print(what, replaced, {k: recovery[k] for k in ("seconds", "phases")})
    assert victim in recovery["lost"] and recovery["kind"] == "peer", (what, recovery)
    assert recovery["bytes_from_peers"] > 0 and not recovery["bytes_from_storage"], (what, recovery)
    assert final["restarts"] == 0, (what, final["events"][-12:])
    members = {n["index"]: n["launch_id"] for n in final["nodes"] if n["role"] == "member"}
    assert members[node] == f"{job_id}-n2-a0", (what, final["nodes"])  # the spare holds the slot
    assert digest(Path(final["checkpoint_dir"])) == uninterrupted, what
