"""False positives of the straggler watch: clean runs of the benchmark job, no rank slowed.

Runs the job of ``benchmarks/worker_throughput.py`` (MLP hidden 512, depth 4, micro-batch 64, A=2;
``torchrun --standalone``, 2 processes, one thread each) ``--rounds`` times with the JobSpec's
``stragglers`` defaults, nothing done to any rank, and counts the ``straggler`` events: each one
is a false positive. Every window's slowdowns (``straggler_window``) are kept, so the same runs
also say what other settings would have named (:func:`worker.train.stragglers.judge` replayed on
them): the defaults are chosen from this table. Then ``--slowed`` runs with rank 1 stopped and
continued from the first window on (the duty cycle of ``tests/faults/test_stragglers.py``) say
how many windows after the slowdown's start the rank was named. Prints the per-window largest slowdown's
percentiles and, per setting, the runs that would have named a rank; the record is the count at
the defaults (target 0).
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.record import emit
from benchmarks.worker_throughput import spec
from tests.faults.test_stragglers import duty_cycle, rank_pid
from tests.integration.launch import REPO, worker_env
from worker.jobspec.stragglers import DEFAULT_SLOWDOWN, DEFAULT_WINDOW_STEPS, DEFAULT_WINDOWS
from worker.train.stragglers import Streaks, judge

SETTINGS = [(s, n) for s in (1.15, 1.2, 1.3, 1.5) for n in (1, 2, 3)]
"""(slowdown, consecutive windows) replayed on the measured windows."""


CMD = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "worker"]
ENV = {"OMP_NUM_THREADS": "1", "ELASTRAIN_METRICS_PORT": "0"}


def clean_run(path: Path) -> list[dict[str, Any]]:
    """One clean run's events (rank 0's stdout)."""
    proc = subprocess.run(
        [*CMD, "--config", str(path)], env=worker_env(ENV), capture_output=True, text=True, cwd=REPO,
        timeout=1800, check=True,
    )  # fmt: skip
    return events_of(proc.stdout)


def events_of(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def slowed_run(path: Path, tmp: Path) -> float | None:
    """One run whose rank 1 is stopped and continued (tests/faults/test_stragglers.py's duty
    cycle) from the first compared window until a rank is named: how many windows after the
    slowdown's start rank 1 was named (None: not named, or another rank was)."""
    out = tmp / "slowed.out"
    with out.open("w") as stdout:
        proc = subprocess.Popen(
            [*CMD, "--config", str(path)], env=worker_env(ENV), cwd=REPO, stdout=stdout,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            pid = rank_pid(path, 1, time.monotonic() + 300)
            duty_cycle(pid, out, proc)
            proc.wait(timeout=1800)
        finally:
            if proc.poll() is None:
                proc.kill()
    found = events_of(out.read_text())
    windows = [e["step"] for e in found if e["event"] == "straggler_window"]
    first = next((e for e in found if e["event"] == "straggler"), None)
    if first is None or first["rank"] != 1 or not windows:
        return None
    return (first["step"] - windows[0]) / DEFAULT_WINDOW_STEPS


def named(
    windows: Sequence[Sequence[float | None]], *, threshold: float, consecutive: int, steps: int
) -> int:
    """How many ranks :func:`judge` names over one run's windows. Pure."""
    streaks, count = Streaks(), 0
    for i, ratios in enumerate(windows, start=1):
        streaks, found = judge(
            streaks, ratios, step=i * steps, window_steps=steps, threshold=threshold, windows=consecutive
        )
        count += len(found)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--slowed", type=int, default=1, help="runs with rank 1 slowed (detection)")
    args = parser.parse_args(argv)
    job = spec("fp32", args.steps) | {"log_every_steps": 100}
    events, runs = 0, []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(job))
        for i in range(args.rounds):
            run = clean_run(path)
            windows = [e["slowdown"] for e in run if e["event"] == "straggler_window"]
            found = [e for e in run if e["event"] == "straggler"]
            events += len(found)
            runs.append(windows)
            worst = max((r for w in windows for r in w if r is not None), default=float("nan"))
            print(
                f"  run {i + 1}: {len(windows)} windows, largest slowdown {worst:.3f}, named {len(found)}",
                flush=True,
            )
        detected = [slowed_run(path, Path(tmp)) for _ in range(args.slowed)]
    largest = sorted(max(r for r in w if r is not None) for run in runs for w in run if any(w))
    print(
        f"straggler watch: {args.rounds} clean runs of {args.steps} steps, windows of {DEFAULT_WINDOW_STEPS}"
    )
    if largest:
        q = statistics.quantiles(largest, n=20, method="inclusive") if len(largest) > 1 else largest * 19
        print(f"  a window's largest slowdown: median {statistics.median(largest):.3f}, p95 {q[18]:.3f}, "
              f"max {largest[-1]:.3f} over {len(largest)} windows")  # fmt: skip
    for threshold, consecutive in SETTINGS:
        flagged = sum(
            named(w, threshold=threshold, consecutive=consecutive, steps=DEFAULT_WINDOW_STEPS) > 0
            for w in runs
        )
        mark = "  <- the defaults" if (threshold, consecutive) == (DEFAULT_SLOWDOWN, DEFAULT_WINDOWS) else ""
        print(
            f"  slowdown {threshold:<4} x {consecutive} windows: {flagged}/{len(runs)} runs named one{mark}"
        )
    print(f"  straggler events at the defaults: {events}")
    shown = ", ".join("not named" if d is None else f"{d:g}" for d in detected)
    print(
        f"  rank 1 slowed (SIGSTOP 50 ms / SIGCONT 5 ms) from the first window: named after {shown} windows"
    )
    print(f"  load average (1 min) before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    emit(
        f"straggler events in {args.rounds} clean runs of the benchmark job (the defaults)",
        events,
        target="0 (20 runs)",
        spread=f"{args.rounds} runs x {args.steps} steps; largest window slowdown "
        + (f"{largest[-1]:.2f}" if largest else "n/a")
        + f"; a slowed rank named after {shown} windows",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
