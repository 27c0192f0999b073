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

Measured (three runs on a 2-core machine): 3 +5-6%, 4 +10-13%, 7 +11-17%, 4xf32 +9-15%, 2+cat within
+-2%: the count of numbers, not their bytes nor the concatenation. At 2 processes, 2 numbers is one per
rank; gloo's ring seems to send fewer messages while some of its segments are empty.
"""

from __future__ import annotations

import sys
import time

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

    from benchmarks.alternating import blocks, dump, new_times

    dist.init_process_group("gloo")
    a = torch.randn(384, 384)
    flag, loss = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
    times = new_times()
    for cycle, arm in blocks(ARMS, iterations, block):
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
    dump(times)
    dist.destroy_process_group()


def main() -> int:
    from benchmarks.alternating import main as run

    title = "gloo all-reduce of a small vector after ~5 ms of compute, 2 processes, one thread each:"
    return run(__doc__ or "", "benchmarks.allreduce_length", worker, arms=ARMS, title=title, throughput=False,
               headline="7")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
