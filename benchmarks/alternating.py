"""The harness of the two-process gloo loops (``allreduce_length``, ``vote_carrier``): the arms
alternate in blocks of iterations (rotating order, :func:`benchmarks.stats.rotation`), rank 0
prints every iteration's time by cycle and arm, and the parent (``torchrun --standalone``, 2
processes, one thread each) prints each arm's median and, per cycle, its median against the
baseline's with the 95% bootstrap interval of the geometric mean."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

Times = dict[int, dict[str, list[float]]]


def blocks(arms: Sequence[str], iterations: int, block: int) -> Iterator[tuple[int, str]]:
    """(cycle, arm) of each iteration: blocks of ``block`` iterations, the arms' order rotating
    from cycle to cycle."""
    from benchmarks.stats import rotation

    for it in range(iterations):
        cycle, k = divmod(it // block, len(arms))
        yield cycle, rotation(tuple(arms), cycle)[k]


def new_times() -> Times:
    return defaultdict(lambda: defaultdict(list))


def dump(times: Times) -> None:
    """Rank 0's last line of output: the times, for :func:`main`'s parent to read."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(json.dumps({str(c): dict(v) for c, v in times.items()}))


def main(
    doc: str,
    module: str,
    worker: Callable[[int, int], None],
    *,
    arms: Sequence[str],
    title: str,
    throughput: bool,
    headline: str,
    warm_cycles: int = 0,
    timeout_s: float = 1800,
) -> int:
    """The command line of a loop: ``--worker`` runs ``worker(iterations, block)`` in each
    process; without it, this launches them and prints. The first arm is the baseline;
    ``throughput``: its time over each arm's (else each arm's over its); the first
    ``warm_cycles`` cycles are left out; the arm ``headline`` against the baseline is the
    benchmark's result record (:func:`benchmarks.record.emit`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=9000)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.iterations, args.block)
        return 0
    from benchmarks.record import emit
    from benchmarks.stats import geomean_interval
    from tests.integration.launch import REPO, worker_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", module,
           "--worker", f"--iterations={args.iterations}", f"--block={args.block}"]  # fmt: skip
    env = worker_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    done = subprocess.run(
        cmd, env=env, cwd=REPO, capture_output=True, text=True, check=True, timeout=timeout_s
    )
    times = json.loads(done.stdout.strip().splitlines()[-1])  # dump()'s line: cycle -> arm -> seconds
    cycles: list[dict[str, Any]] = list(times.values())[warm_cycles:]
    base = arms[0]
    print(title)
    for arm in arms:
        median = statistics.median(t for c in cycles for t in c.get(arm, []))
        print(f"  {arm:8s} median iteration {median * 1e3:.3f} ms")
    for arm in arms[1:]:
        ratios = [
            statistics.median(c[base]) / statistics.median(c[arm])
            if throughput
            else statistics.median(c[arm]) / statistics.median(c[base])
            for c in cycles
            if c.get(arm) and c.get(base)
        ]
        mean, lo, hi = geomean_interval(ratios)
        what = f"{arm} / {base}, {'throughput' if throughput else 'time per iteration'}"
        print(f"  {what}: {mean:.4f} [{lo:.4f}, {hi:.4f}] over {len(ratios)} cycles")
        if arm == headline:
            emit(f"{what} (geometric mean of the cycles)", mean,
                 spread=f"95% interval [{lo:.4f}, {hi:.4f}], {len(ratios)} cycles")  # fmt: skip
    return 0
