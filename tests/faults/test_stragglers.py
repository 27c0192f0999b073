"""A straggler made from outside the worker: one rank's process is stopped and continued in a
duty cycle (SIGSTOP 50 ms, SIGCONT 5 ms: a throttled host, a CPU quota, a noisy neighbour), and
the group names that rank.

Two processes under the README's bare torchrun command, the benchmark MLP (a step's compute spans
several stop periods, so the stops slow every step of the victim alike), the straggler watch at
windows of 10 steps (``stragglers.window_steps``), named after 2 slow windows. The duty cycle starts once the
first window was compared (the group is training at its normal rate) and stops when a rank is
named, or when the run ends.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.faults.duty import stop_cycles
from tests.faults.test_sigstop import worker_pids
from tests.integration.launch import REPO, Run, torchrun_cmd, worker_env, write_spec
from tests.seeds import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 60


def spec(steps: int) -> dict[str, Any]:
    return {
        "name": "straggler",
        "model": {"name": "mlp", "kwargs": {"hidden": 512, "depth": 4}},
        "data": {"name": "synthetic", "samples": 8192, "kwargs": {"input_dim": 128}},
        "micro_batch_size": 32,
        "grad_accum_steps": 2,
        "max_steps": steps,
        "seed": 3,
        "log_every_steps": 100,
        "stragglers": {"window_steps": 10, "windows": 2},
    }


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def rank_pid(spec_path: Path, rank: int, deadline: float) -> int:
    """The worker process of ``rank`` (read from its environment) once both workers exist."""
    while len(pids := worker_pids(spec_path)) < 2:
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    for pid in pids:
        if f"RANK={rank}".encode() in (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0"):
            return pid
    raise AssertionError(f"no worker of rank {rank} among {pids}")


def duty_cycle(pid: int, out: Path, proc: subprocess.Popen[bytes]) -> str:
    """Stop and continue ``pid`` from the first compared window until a rank is named or the
    run ends; the process is left running. Says how many cycles ran, over how long."""
    while proc.poll() is None and '"straggler_window"' not in out.read_text():
        time.sleep(0.02)
    return stop_cycles(pid, lambda: proc.poll() is not None or '"event": "straggler"' in out.read_text())


@seeded
def test_a_rank_in_a_stop_duty_cycle_is_named(tmp_path: Path, seed: int) -> None:
    victim = random.Random(seed).randrange(2)
    spec_path = write_spec(tmp_path, spec(steps=STEPS))
    out = tmp_path / "stdout"
    with out.open("w") as stdout, (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen(
            torchrun_cmd(2, spec_path), env=worker_env(), cwd=REPO, stdout=stdout, stderr=stderr
        )
        try:
            cycled = duty_cycle(rank_pid(spec_path, victim, time.monotonic() + 120), out, proc)
            code = proc.wait(timeout=180)
        finally:
            if proc.poll() is None:
                proc.kill()
    run = Run(code, out.read_text(), (tmp_path / "stderr").read_text())
    what = f"seed={seed} victim=rank {victim}, {cycled}"
    assert run.code == 0, f"{what}: {run.stderr[-3000:]}"
    assert run.last("finished")["step"] == STEPS
    named = run.all("straggler")
    assert named, f"{what}: no rank named; windows: {[e['slowdown'] for e in run.all('straggler_window')]}"
    first = named[0]
    assert first["rank"] == victim and first["node"] == 0, f"{what}: {first}"
    assert first["slowdown"] > first["threshold"] == 1.3 and first["windows"] == 2, f"{what}: {first}"
    assert first["step"] - first["first_step"] + 1 == 20, f"{what}: two windows of 10 steps: {first}"
    assert f"rank {victim} on node 0 computed" in run.stderr, f"{what}: the line people read"
