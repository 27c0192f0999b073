"""SIGSTOP a worker, then SIGCONT: the job finishes with the uninterrupted run's digest.

What torch 2.13 + gloo does (worker/dist.py init_group uses a 300 s collective timeout, and
torchrun's local agent watches only exit codes, not liveness): a stop shorter than the timeout
stalls the peers inside the all-reduce and the group simply carries on after SIGCONT -- nothing
re-forms. A stop longer than the timeout is the slow row (over 5 minutes): the peer's collective
times out, it exits non-zero, torchrun tears down the group (including the stopped process) and
restarts it from the newest checkpoint.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.conftest import Reference, seeded
from tests.integration.launch import REPO, Run, torchrun_cmd, worker_env, write_spec
from tests.integration.worker.test_resume import spec

pytestmark = [pytest.mark.faults, pytest.mark.integration]
COLLECTIVE_TIMEOUT_S = 20.0  # ELASTRAIN_COLLECTIVE_TIMEOUT_S for these rows (the default is 300 s)


def worker_pids(spec_path: Path) -> list[int]:
    """Worker processes (not the torchrun agent) started with ``--config spec_path``, by rank order."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(spec_path).encode() in cmd and b"torch.distributed.run" not in cmd and b"worker" in cmd:
            found.append(int(entry.name))
    return sorted(found)


def rank_of(pid: int) -> int:
    env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return next(int(e[5:]) for e in env if e.startswith(b"RANK="))


def stop_and_continue(tmp: Path, seed: int, pause: float) -> tuple[Run, int]:
    rng = random.Random(seed)
    victim_rank = rng.randrange(2)
    spec_path = write_spec(tmp, spec(tmp / "ck"))
    out, err = (tmp / "stdout").open("w+"), (tmp / "stderr").open("w+")
    env = worker_env(
        {
            "ELASTRAIN_FAILPOINTS": "after_grad_sync=sleep:0.05",
            "ELASTRAIN_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S),
        }
    )
    cmd = torchrun_cmd(2, spec_path, max_restarts=2)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 120
        while '"checkpoint_published"' not in (tmp / "stdout").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "stderr").read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(rng.uniform(0, 0.5))
        victim = next(p for p in worker_pids(spec_path) if rank_of(p) == victim_rank)
        os.kill(victim, signal.SIGSTOP)
        time.sleep(pause)
        os.kill(victim, signal.SIGCONT)
        code = proc.wait(timeout=COLLECTIVE_TIMEOUT_S + 240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return Run(code, (tmp / "stdout").read_text(), (tmp / "stderr").read_text()), victim_rank


@seeded
def test_sigstop_a_worker_then_sigcont(tmp_path: Path, reference: Reference, seed: int) -> None:
    pause = random.Random(seed + 1).uniform(3.0, 8.0)
    run, rank = stop_and_continue(tmp_path, seed, pause)
    what = f"seed={seed} rank={rank} pause={pause:.1f}s"
    assert run.code == 0, f"{what}: {run.stderr[-3000:]}"
    assert run.last("finished")["params_digest"] == reference.digest, what


@seeded
def test_sigstop_past_the_collective_timeout(tmp_path: Path, reference: Reference, seed: int) -> None:
    run, rank = stop_and_continue(tmp_path, seed, COLLECTIVE_TIMEOUT_S + 20)
    what = f"seed={seed} rank={rank}"
    assert run.code == 0, f"{what}: {run.stderr[-3000:]}"
    assert run.all("resumed"), f"{what}: the group did not re-form from a checkpoint"
    assert run.last("finished")["params_digest"] == reference.digest, what
