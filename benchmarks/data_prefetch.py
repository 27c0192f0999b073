"""samples/s of ``-m worker`` when ``batch()`` costs half the step, against the same run with free
data, side by side in one run.

Three runs a round, in rotating order so that drift on a shared machine hits all: free data (the
built-in synthetic set), slow data with ``data.prefetch`` unset (so loaded ahead: its batch()
takes over 1 ms) and slow data loaded on the training thread (``data.prefetch`` 0: what every run
paid before). Slow data is :mod:`benchmarks.slow_data` over the same synthetic set, whose
``batch()`` costs half the free run's step (its lower quartile, the smaller of two runs first),
spread over the step's micro-batches. ``--kind io`` (default) waits, as reading slow storage does;
``--kind cpu`` computes, and on a machine whose cores the training ranks already fill nothing can
hide that (the ratio shows it). Prints each rate, the medians with their spread, the ratios to
free data (target for io: slow ahead / free >= 0.95) and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.record import emit
from benchmarks.stats import spread
from benchmarks.worker_throughput import _torchrun
from benchmarks.worker_throughput import spec as free_spec


def run(path: Path, nproc: int) -> tuple[float, float]:
    """samples/s over the progress events after the first, and the lower quartile of the step
    seconds (a step of a quiet moment: the machine is shared)."""
    out = _torchrun(nproc, "-m", "worker", "--config", str(path))
    progress = [json.loads(line) for line in out.splitlines() if '"event": "progress"' in line]
    first, last = progress[0], progress[-1]
    steps = [s for p in progress[1:] for s in p["step_seconds"]]
    return (last["samples_seen"] - first["samples_seen"]) / (last["time"] - first["time"]), statistics.median(
        steps
    )


def slow_spec(base: dict[str, Any], *, cost_ms: float, kind: str, prefetch: int | None) -> dict[str, Any]:
    data = base["data"]
    kwargs = {**data["kwargs"], "cost_ms": cost_ms, "kind": kind}
    slow = {"factory": "benchmarks.slow_data:slow", "samples": data["samples"], "kwargs": kwargs}
    return base | {"data": slow | ({} if prefetch is None else {"prefetch": prefetch})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--kind", choices=("io", "cpu"), default="io")
    parser.add_argument("--share", type=float, default=0.5, help="batch() cost as a share of the free step")
    args = parser.parse_args(argv)
    base = free_spec("fp32", args.steps)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        free = Path(tmp) / "free.json"
        free.write_text(json.dumps(base))
        step_s = min(run(free, args.nproc)[1] for _ in range(2))  # calibration: the free step
        cost_ms = 1000 * args.share * step_s / base["grad_accum_steps"]
        paths = {"free": free}
        for name, prefetch in (("slow, ahead", None), ("slow, inline", 0)):
            paths[name] = Path(tmp) / f"{name.replace(', ', '-')}.json"
            paths[name].write_text(
                json.dumps(slow_spec(base, cost_ms=cost_ms, kind=args.kind, prefetch=prefetch))
            )
        rates: dict[str, list[float]] = {name: [] for name in paths}
        names = list(paths)
        for i in range(args.rounds):
            for name in names[i % 3 :] + names[: i % 3]:
                rates[name].append(run(paths[name], args.nproc)[0])
    print(
        f"data loading ({args.kind}: batch() costs {cost_ms:.1f} ms, {args.share:.0%} of a "
        f"{1000 * step_s:.1f} ms step over {base['grad_accum_steps']} micro-batches; W={args.nproc}, "
        f"{args.rounds} rounds, {args.steps} steps)"
    )
    for name, values in rates.items():
        shown = ", ".join(f"{r:,.0f}" for r in values)
        print(f"  {name:<13} samples/s: {shown}  {spread(values, 0, grouping=True)}")
    f = statistics.median(rates["free"])
    for name in ("slow, ahead", "slow, inline"):
        per_round = [s / r for s, r in zip(rates[name], rates["free"], strict=True)]
        print(
            f"  {name} / free: {statistics.median(rates[name]) / f:.3f} (medians); per round "
            f"{', '.join(f'{r:.3f}' for r in per_round)}" + ("  (target >= 0.95)" if "ahead" in name else "")
        )
    print(f"  load average (1 min) before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    ahead = [s / r for s, r in zip(rates["slow, ahead"], rates["free"], strict=True)]
    emit(f"slow ({args.kind}) loaded ahead / free samples/s, median of the rounds' ratios",
         statistics.median(ahead), target=">= 0.95" if args.kind == "io" else "", rounds=ahead)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
