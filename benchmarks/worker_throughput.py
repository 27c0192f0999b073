"""samples/s of ``-m worker`` against a bare torchrun + DDP loop, side by side in one run.

Same model, data, batch, precision, bucket size, DDP options (``gradient_as_bucket_view``) and
threads (``OMP_NUM_THREADS=1``); checkpointing off, the worker's metrics exporter on (its default).
Rounds interleave in alternating order (bare, worker; worker, bare; ...) so that drift on a shared
machine hits both; prints each rate, the medians with their spread (min-max), the ratio of the
medians and the median of the per-round ratios (target >= 0.98), and the load average around it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.record import emit
from benchmarks.stats import spread
from tests.integration.launch import REPO, worker_env


def spec(precision: str, steps: int) -> dict[str, object]:
    return {
        "name": "bench",
        "model": {"name": "mlp", "kwargs": {"hidden": 512, "depth": 4}},
        "data": {"name": "synthetic", "samples": 65536, "kwargs": {"input_dim": 128}},
        "precision": precision,
        "micro_batch_size": 64,
        "grad_accum_steps": 2,
        "max_steps": steps,
        "log_every_steps": 10,
        "ddp": {"bucket_cap_mb": 25.0},
    }


def _torchrun(nproc: int, *args: str, timeout: float | None = 900) -> str:
    """stdout of ``torchrun --standalone`` with ``args``, one thread per process, in the
    environment users get (:func:`tests.integration.launch.worker_env`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = worker_env({"OMP_NUM_THREADS": "1"})
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=timeout, check=True)
    return proc.stdout


def bare_rate(path: Path, nproc: int) -> float:
    out = _torchrun(nproc, str(REPO / "benchmarks" / "bare_ddp.py"), str(path))
    return float(json.loads(out.strip().splitlines()[-1])["samples_per_second"])


def worker_rate(path: Path, nproc: int) -> float:
    out = _torchrun(nproc, "-m", "worker", "--config", str(path))
    progress = [json.loads(line) for line in out.splitlines() if '"event": "progress"' in line]
    first, last = progress[0], progress[-1]
    return (last["samples_seen"] - first["samples_seen"]) / (last["time"] - first["time"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(spec(args.precision, args.steps)))
        bare, ours = [], []
        load = os.getloadavg()[0]
        for i in range(args.rounds):
            if i % 2:
                ours.append(worker_rate(path, args.nproc))
                bare.append(bare_rate(path, args.nproc))
            else:
                bare.append(bare_rate(path, args.nproc))
                ours.append(worker_rate(path, args.nproc))
    b, w = statistics.median(bare), statistics.median(ours)
    ratios = [o / r for o, r in zip(ours, bare, strict=True)]
    print(f"worker throughput ({args.precision}, W={args.nproc}, {args.rounds} rounds, {args.steps} steps)")
    shown = ", ".join(f"{r:,.0f}" for r in bare)
    print(f"  bare torchrun+DDP samples/s: {shown}  {spread(bare, 0, grouping=True)}")
    shown = ", ".join(f"{r:,.0f}" for r in ours)
    print(f"  -m worker         samples/s: {shown}  {spread(ours, 0, grouping=True)}")
    print(
        f"  ratio worker/bare: {w / b:.3f} (medians); per round {', '.join(f'{r:.3f}' for r in ratios)}, "
        f"median {statistics.median(ratios):.3f}  (target >= 0.98)"
    )
    print(f"  load average (1 min) before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    emit("worker / bare samples/s, median of the rounds' ratios", statistics.median(ratios),
         target=">= 0.98", rounds=ratios)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
