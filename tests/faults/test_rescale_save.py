"""Rescale during a save: the world size changes while a checkpoint save is in progress.

The mechanism is torchrun's own: agent A (``--nnodes 1:2``, 2 processes, the project's etcd-v3
rendezvous on a real etcd) trains at world size 2. At its third save (step 30) one rank sleeps
at a seeded checkpoint failpoint (``sleep:SECONDS``, long enough never to end by itself); once
that sleep has begun, agent B (2 processes) joins the rendezvous. A sees a node waiting, stops
its workers in the middle of the save and the group re-forms at world size 4.

The invariant: the interrupted save either published at the old world size (the failpoints
after the publish rename) or aborted (every failpoint before it); the new group resumes from the
newest published step, which verifies; every ``step-*`` directory verifies, no ``.staging-*``
is left, and the job finishes at world size 4 with every sample seen exactly once per epoch
(the sample trace, the newest generation's work per step).

The failpoint is armed at its third hit in a process (``#3``): the new group resumes at step 20
or 30 and saves at most twice, so it never sleeps.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from service.etcd.server import EtcdServer
from tests.faults.test_sigstop import worker_pids
from tests.integration.launch import REPO, worker_env, write_spec
from tests.integration.rendezvous.conftest import declared_handler
from tests.integration.worker.test_resume import spec
from tests.integration.worker.traces import committed
from tests.seeds import seeded
from worker.checkpoint.verify import load_manifest, verify_checkpoint

pytestmark = [pytest.mark.faults, pytest.mark.integration]
SLEEP_S = 600  # never ends by itself: the rescale must end it
# (failpoint, ranks that reach it, whether the save is published when the group stops there)
CHOICES: list[tuple[str, tuple[int, ...], bool]] = [
    ("after_shard_write", (0, 1), False),
    ("before_report", (0, 1), False),
    ("before_manifest_write", (0,), False),
    ("before_publish_rename", (0,), False),
    ("after_publish_rename", (0,), True),
    ("before_latest_update", (0,), True),
]
OLD_WORLD, NEW_WORLD, SAVED_STEP, MAX_STEPS, GLOBAL_BATCH, SAMPLES = 2, 4, 30, 40, 32, 512


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def agent_env(extra: dict[str, str]) -> dict[str, str]:
    """The worker environment; torchrun finds the etcd-v3 backend through the entry point the
    installed distribution declares (checked first, so a missing one fails here, clearly)."""
    declared_handler()
    return worker_env(extra)


@dataclass
class Agents:
    """torchrun agents of one rendezvous id, each in its own session, logs under ``tmp``."""

    tmp: Path
    endpoint: str
    spec_path: Path
    env: dict[str, str]
    run_id: str = field(default_factory=lambda: f"rescale-{uuid.uuid4().hex[:8]}")
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self) -> subprocess.Popen[bytes]:
        index = len(self.procs)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", f"--nproc-per-node={OLD_WORLD}",
            "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
            "--max-restarts=2", "--monitor-interval=0.2", "-m", "worker", "--config", str(self.spec_path),
        ]  # fmt: skip
        with open(self.log(index), "wb") as log:
            proc = subprocess.Popen(
                cmd, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def log(self, index: int) -> Path:
        return self.tmp / f"agent-{index}.log"

    def logs(self) -> str:
        return "\n".join(
            f"--- agent {i}\n{self.log(i).read_text(errors='replace')[-3000:]}"
            for i in range(len(self.procs))
        )

    def wait_for_text(self, index: int, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(index).read_text(errors="replace"):
            assert self.procs[index].poll() is None, f"agent {index} exited early:\n{self.logs()}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout:.0f} s:\n{self.logs()}"
            time.sleep(0.1)

    def kill(self) -> None:
        """Kill what is left: the agents' sessions, then their workers (each in its own session)."""
        workers = worker_pids(self.spec_path)
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def events(ck: Path) -> list[dict[str, Any]]:
    """Rank 0's events of every group (the run directory's events.jsonl)."""
    return [json.loads(line) for line in (ck / "events.jsonl").read_text().splitlines() if line.strip()]


def rescale_while_saving(tmp: Path, etcd: EtcdServer, *, arm: str, sleeping: str) -> tuple[list[int], str]:
    """Run agent A; once its save sleeps at ``sleeping``, start agent B. Returns the agents' exit
    codes and log tails."""
    trace = tmp / "trace"
    trace.mkdir()
    over = {"max_steps": MAX_STEPS, "grad_accum_steps": None, "global_batch_size": GLOBAL_BATCH}
    model = {"name": "mlp", "kwargs": {"hidden": 32, "norm": "layer"}}
    spec_path = write_spec(tmp, spec(tmp / "ck", model=model, **over))
    env = agent_env({"ELASTRAIN_FAILPOINTS": arm, "ELASTRAIN_TRACE_SAMPLES": str(trace)})
    agents = Agents(tmp, etcd.endpoint, spec_path, env)
    try:
        agents.start()
        agents.wait_for_text(0, f"elastrain failpoint {sleeping}: sleep:", timeout=240)
        agents.start()
        codes = [proc.wait(timeout=300) for proc in agents.procs]
    finally:
        agents.kill()
    return codes, agents.logs()


def groups(log: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(generation, world size) of every worker group, in order (their ``run_record`` events)."""
    return [(e["generation"], e["world_size"]) for e in log if e["event"] == "run_record"]


def check_the_save_in_flight(ck: Path, log: list[dict[str, Any]], *, old_gen: int, publishes: bool) -> None:
    """The save of SAVED_STEP that the rescale interrupted either published at the old world size
    (no group saved the step again) or aborted (the next group collected its staging directory
    and saved the step itself, at the new world size)."""
    manifest = load_manifest(ck / f"step-{SAVED_STEP:08d}")
    saved = [e for e in log if e["event"] == "checkpoint_published" and e["step"] == SAVED_STEP]
    staging = f".staging-{SAVED_STEP:08d}-{old_gen}"
    collected = [n for e in log if e["event"] == "checkpoint_orphans_collected" for n in e["removed"]]
    if publishes:
        assert (manifest.generation, manifest.world_size) == (old_gen, OLD_WORLD), manifest
        assert not saved, f"step {SAVED_STEP} was published by the old group and then again: {saved}"
    else:
        assert manifest.generation != old_gen and manifest.world_size == NEW_WORLD, manifest
        assert staging in collected, f"the old group's {staging} was not collected: {collected}"
        assert len(saved) == 1, f"the aborted step was published {len(saved)} times by the new group"


def check_the_next_group(ck: Path, log: list[dict[str, Any]], *, old_gen: int, publishes: bool) -> None:
    """The new group loaded the newest published step (a verified one, never staging), finished."""
    assert [w for _, w in groups(log)] == [OLD_WORLD, NEW_WORLD] and groups(log)[0][0] == old_gen, groups(log)
    resumed = [e for e in log if e["event"] == "resumed"]
    restored = [e for e in log if e["event"] == "checkpoint_restored"]
    want = ck / f"step-{SAVED_STEP if publishes else SAVED_STEP - 10:08d}"
    assert len(resumed) == 1 and resumed[0]["checkpoint"] == str(want), resumed
    assert resumed[0]["batch_plan"]["world_size"] == NEW_WORLD, resumed
    assert [e["path"] for e in restored] == [str(want)] and not verify_checkpoint(want)[1], restored
    finished = [e for e in log if e["event"] == "finished"]
    assert len(finished) == 1 and finished[0]["world_size"] == NEW_WORLD, finished
    assert (finished[0]["step"], finished[0]["samples_seen"]) == (MAX_STEPS, MAX_STEPS * GLOBAL_BATCH)


def check_the_directory(ck: Path) -> None:
    """Every step directory verifies, ``latest`` names the last step, nothing dotted is left
    (no ``.staging-*``, ``.trash-*``, nor a step set aside)."""
    steps = sorted(ck.glob("step-*"))
    assert steps and all(not verify_checkpoint(p)[1] for p in steps), [verify_checkpoint(p) for p in steps]
    assert (ck / "latest").read_text().strip() == f"step-{MAX_STEPS:08d}"
    assert not [p.name for p in ck.iterdir() if p.name.startswith(".")], sorted(p.name for p in ck.iterdir())


def check_every_sample_once(trace: Path) -> None:
    """Per epoch, each sample once across both groups (for each step, the newest group's work)."""
    seen = committed(trace)
    assert set(seen.values()) == {1}, [k for k, n in seen.items() if n > 1][:10]
    per_epoch = {e: {i for (ep, i) in seen if ep == e} for e in {ep for ep, _ in seen}}
    tail = MAX_STEPS * GLOBAL_BATCH - 2 * SAMPLES
    assert per_epoch[0] == per_epoch[1] == set(range(SAMPLES)) and len(per_epoch[2]) == tail, per_epoch.keys()


@seeded
def test_rescale_during_a_save(tmp_path: Path, etcd: EtcdServer, seed: int) -> None:
    rng = random.Random(seed)
    name, ranks, publishes = rng.choice(CHOICES)
    arm = f"{name}=sleep:{SLEEP_S}@{rng.choice(ranks)}#3"
    what = f"seed={seed} {arm}"
    codes, logs = rescale_while_saving(tmp_path, etcd, arm=arm, sleeping=name)
    assert codes == [0, 0], f"{what}: exit codes {codes}\n{logs}"
    ck = tmp_path / "ck"
    log = events(ck)
    old_gen = groups(log)[0][0]
    try:
        check_the_save_in_flight(ck, log, old_gen=old_gen, publishes=publishes)
        check_the_next_group(ck, log, old_gen=old_gen, publishes=publishes)
        check_the_directory(ck)
        check_every_sample_once(tmp_path / "trace")
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from exc
