"""The replicas' comparison at its default interval against none, with an A/A control, in one job.

``python -m benchmarks.integrity_check [--rounds N] [--steps S] [--block B]``

Each round is one ``-m worker`` job (2 processes under torchrun, one thread each, the benchmark
MLP of :mod:`benchmarks.worker_throughput`, no checkpoints) whose model factory, :func:`mlp`,
installs a probe: from step ``warm`` on, the windows go in blocks of ``block``, three blocks a
cycle, one per arm (``off``, ``on``, ``control``), their order rotating from cycle to cycle. In
``on`` blocks the replicas compare their state as the job's spec says (``integrity.every_steps``,
the default); in ``off`` and ``control`` blocks they do not (``control`` against ``off`` is the
same arm twice). Every rank computes the same arm from the same step, so the comparison's
collective runs on all of them or on none. A block holds a whole number of intervals, so each
``on`` block pays for its checks in full.

Prints: what hashing costs outside the job (all of the state and a quarter, on this process),
each check's time on the training thread in the job (hashing its part, starting the exchange,
judging the previous one), its share of the ``on`` windows' time, and the throughput of ``on``
and of ``control`` against ``off``: per cycle the ratio of the arms' mean window times (a mean, not
a median: the check is one window in ``every_steps``), their geometric mean with its 95%
bootstrap interval and the verdict against the target (at least 0.99).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import block_arm

ARMS = ("off", "on", "control")
TARGET = 0.99
_installed = False


def arm_at(step: int, *, block: int, warm: int) -> tuple[str, int] | None:
    """The arm and cycle of the window that trains ``step`` + 1 (:func:`benchmarks.stats.block_arm`)."""
    return block_arm(ARMS, step, block=block, warm=warm)


def mlp(meta: dict[str, Any], *, hidden: int, depth: int, block: int, warm: int, out: str) -> Any:
    """The benchmark's model (the factory contract), with the probe installed once per process."""
    from worker.start.models import MLP

    install(block=block, warm=warm, out=Path(out))
    return MLP(int(meta["input_dim"]), int(meta["output_dim"]), hidden=hidden, depth=depth)


def install(*, block: int, warm: int, out: Path) -> None:
    global _installed
    if _installed:
        return
    _installed = True
    from worker.train.integrity import ReplicaCheck
    from worker.train.trainer import Trainer

    window, finish, check = Trainer.window, Trainer._finish, ReplicaCheck.check
    windows: list[tuple[str, int, float]] = []
    checks: list[float] = []

    def timed_check(self: ReplicaCheck, step: int, *, full: bool) -> None:
        started = time.perf_counter()
        try:
            check(self, step, full=full)
        finally:
            checks.append(time.perf_counter() - started)

    def probed(self: Trainer, feed: Any) -> None:
        got = arm_at(self.progress.step, block=block, warm=warm)
        if got is None:
            window(self, feed)
            return
        arm, cycle = got
        held = self.replicas
        if arm != "on":
            self.replicas = None
        started = time.perf_counter()
        try:
            window(self, feed)
        finally:
            windows.append((arm, cycle, time.perf_counter() - started))
            self.replicas = held

    def finished(self: Trainer) -> dict[str, Any]:
        if self.info.rank == 0:
            (out / f"probe-{os.getpid()}.json").write_text(json.dumps({"windows": windows, "checks": checks}))
        return finish(self)

    ReplicaCheck.check = timed_check  # type: ignore[method-assign]
    Trainer.window = probed  # type: ignore[method-assign]
    Trainer._finish = finished  # type: ignore[method-assign]


def spec(steps: int, *, block: int, warm: int, out: Path) -> dict[str, Any]:
    kwargs = {"hidden": 512, "depth": 4, "block": block, "warm": warm, "out": str(out)}
    return {
        "name": "bench-integrity",
        "model": {"factory": "benchmarks.integrity_check:mlp", "kwargs": kwargs},
        "data": {"name": "synthetic", "samples": 65536, "kwargs": {"input_dim": 128}},
        "micro_batch_size": 64,
        "grad_accum_steps": 2,
        "max_steps": steps,
        "log_every_steps": 100,
    }


def hashing_costs() -> tuple[float, float, float]:
    """(MB of state, ms to hash all of it, ms for a quarter) of the benchmark MLP with AdamW's
    moments, on this process (the best of 20)."""
    import torch

    from worker.start.models import MLP
    from worker.train.integrity import state_tensors, tensor_digests
    from worker.train.replicas import split

    torch.manual_seed(0)
    model = MLP(128, 1, hidden=512, depth=4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 128)).sum().backward()
    optimizer.step()
    tensors = [t for _, t in state_tensors(model, optimizer)]
    quarter = [tensors[i] for i in split([t.numel() * t.element_size() for t in tensors])[0]]

    def best(ts: list[Any]) -> float:
        times = []
        for _ in range(20):
            started = time.perf_counter()
            tensor_digests(ts)
            times.append(time.perf_counter() - started)
        return min(times) * 1e3

    return sum(t.numel() * t.element_size() for t in tensors) / 1e6, best(tensors), best(quarter)


def one_round(steps: int, block: int, warm: int) -> dict[str, Any]:
    from tests.integration.launch import REPO, worker_env

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec(steps, block=block, warm=warm, out=Path(tmp))))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "worker", "--config", str(path)]  # fmt: skip
        env = worker_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=True, timeout=1800)
        [probe] = Path(tmp).glob("probe-*.json")
        result: dict[str, Any] = json.loads(probe.read_text())
        return result


def ratios(windows: list[list[Any]], arm: str) -> list[float]:
    """Per cycle with both arms: the mean ``off`` window time over the mean ``arm`` one. Pure."""
    by: dict[int, dict[str, list[float]]] = {}
    for name, cycle, seconds in windows:
        by.setdefault(cycle, {}).setdefault(name, []).append(seconds)
    return [
        statistics.fmean(c["off"]) / statistics.fmean(c[arm]) for c in by.values() if "off" in c and arm in c
    ]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.record import emit
    from benchmarks.stats import geomean_interval, verdict

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--block", type=int, default=20, help="windows a block (a multiple of 10)")
    parser.add_argument("--warm", type=int, default=40)
    args = parser.parse_args(argv)
    mb, full_ms, quarter_ms = hashing_costs()
    windows: list[list[Any]] = []
    checks: list[float] = []
    for r in range(args.rounds):
        got = one_round(args.steps, args.block, args.warm)
        windows += [[a, f"{r}-{c}", s] for a, c, s in got["windows"]]  # each round's cycles apart
        checks += got["checks"]
    on_time = sum(s for a, _, s in windows if a == "on")
    step_ms = statistics.median(s for a, _, s in windows if a == "off") * 1e3
    print(f"integrity check vs none (W=2, benchmark MLP, {args.rounds} rounds x {args.steps} steps)")
    print(f"  hashing the state ({mb:.1f} MB: parameters and AdamW moments): all {full_ms:.3f} ms, "
          f"a quarter {quarter_ms:.3f} ms; median step {step_ms:.2f} ms")  # fmt: skip
    print(f"  checks in the job: {len(checks)}, median {statistics.median(checks) * 1e3:.3f} ms, "
          f"{sum(checks) / on_time:.2%} of the on windows' time")  # fmt: skip
    for arm in ("on", "control"):
        interval = geomean_interval(ratios(windows, arm))
        mean, lo, hi = interval
        print(f"  {arm} / off throughput: {mean:.4f} [{lo:.4f}, {hi:.4f}] over {len(ratios(windows, arm))} "
              f"cycles: {verdict(interval, TARGET)} (target >= {TARGET})")  # fmt: skip
    mean, lo, hi = geomean_interval(ratios(windows, "on"))
    cmean, clo, chi = geomean_interval(ratios(windows, "control"))
    emit("integrity check at its default interval / none, samples/s (geometric mean of the cycles)", mean,
         target=f">= {TARGET}", spread=f"95% interval [{lo:.4f}, {hi:.4f}]; A/A control {cmean:.4f} "
         f"[{clo:.4f}, {chi:.4f}]")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
