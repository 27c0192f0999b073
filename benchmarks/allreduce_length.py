"""What a few more numbers cost on the step's small all-reduce (gloo, 2 processes, CPU).

Peer mode's commit vote adds ``1 + 2 W`` float64 to the step's all-reduce of 2 (the non-finite
flag and the loss): 7 at W=2. ``benchmarks/peer_steady.py --keep commit --dummy`` priced that
at ~2% of a 20 ms window in wall time with almost no CPU. This reproduces it without the worker:
two processes (``torchrun --standalone``, one thread each) run a loop of ~5 ms of matmuls and one
async all-reduce of a small vector, the arms alternating in blocks of 10 iterations (rotating
order, as the step benchmarks do): ``2`` (restart mode's vector of float64), ``2+cat`` (the vote's
tensor built and concatenated, but 2 numbers sent), ``3``, ``4``, ``7`` (the vote's length at
W=2) float64, and ``4xf32`` (as many bytes as ``2``). Prints each arm's median iteration and, per
cycle, its median over ``2``'s with the 95% bootstrap interval of the geometric mean.

Measured (stop 36, three runs): 3 +5-6%, 4 +10-13%, 7 +11-17%, 4xf32 +9-15%, 2+cat within
+-2%: the count of numbers, not their bytes nor the concatenation. At 2 processes, 2 numbers is one per
rank; gloo's ring seems to send fewer messages while some of its segments are empty.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict

ARMS = ("2", "2+cat", "3", "4", "4xf32", "7")
VOTE = [
    0.0,
    3.0,
    5001.0,
    3.0,
    5001.0,
]  # the commit vote at W=2: reform, then (generation + 1, version + 1) a rank


def worker(iterations: int, block: int) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.stats import rotation

    dist.init_process_group("gloo")
    a = torch.randn(384, 384)
    flag, loss = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
    times: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for it in range(iterations):
        cycle, k = divmod(it // block, len(ARMS))
        arm = rotation(ARMS, cycle)[k]
        started = time.perf_counter()
        for _ in range(3):
            a = torch.tanh(a @ a * 1e-3)
        shared = torch.stack([flag, loss])
        if arm in ("2+cat", "7"):
            joined = torch.cat([shared, torch.tensor(VOTE, dtype=torch.float64)])
            shared = joined if arm == "7" else shared
        elif arm in ("3", "4"):
            shared = torch.zeros(int(arm), dtype=torch.float64)
        elif arm == "4xf32":
            shared = torch.zeros(4, dtype=torch.float32)
        dist.all_reduce(shared, async_op=True).wait()
        shared.tolist()
        times[cycle][arm].append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        print(json.dumps({str(c): dict(v) for c, v in times.items()}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=9000)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.iterations, args.block)
        return 0
    from benchmarks.stats import geomean_interval
    from tests.integration.launch import REPO, worker_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
           "benchmarks.allreduce_length", "--worker", f"--iterations={args.iterations}",
           f"--block={args.block}"]  # fmt: skip
    env = worker_env({"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    out = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, check=True, timeout=900)
    cycles = json.loads(out.stdout.strip().splitlines()[-1])
    medians = {arm: statistics.median(t for c in cycles.values() for t in c.get(arm, [])) for arm in ARMS}
    print("gloo all-reduce of a small vector after ~5 ms of compute, 2 processes, one thread each:")
    for arm in ARMS:
        print(f"  {arm:6s} median iteration {medians[arm] * 1e3:.3f} ms")
    for arm in ARMS[1:]:
        ratios = [
            statistics.median(c[arm]) / statistics.median(c["2"])
            for c in cycles.values()
            if c.get(arm) and c.get("2")
        ]
        mean, lo, hi = geomean_interval(ratios)
        print(f"  {arm} / 2, time per iteration: {mean:.4f} [{lo:.4f}, {hi:.4f}] over {len(ratios)} cycles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
