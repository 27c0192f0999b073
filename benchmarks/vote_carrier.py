"""Where peer mode's commit vote can ride in a DDP step without costing the step (gloo, CPU).

The vote (:mod:`worker.recovery.vote`) needs every member's numbers summed before the apply.
On this machine a gloo all-reduce costs by the count of its numbers, not their bytes
(``benchmarks/allreduce_length.py``), and the step's own all-reduce carries 2 (the non-finite
flag and the loss). This times one DDP training step (the benchmark MLP of
``benchmarks/peer_steady.py``, hidden 512, depth 4, micro-batch 64; ``torchrun --standalone``, 2
processes, one thread each) with the vote carried each way, every arm its own DDP wrapper around
an identical copy of the model, in alternating blocks of 10 steps (rotating order):

* ``restart``: DDP's built-in bucket all-reduce, the step's 2 numbers (restart mode);
* ``whole``: the whole vote appended to the step's all-reduce (7 numbers at W=2, every window: the
  alternative to ``flag``);
* ``flag``: the re-formation request added to the flag's element, 2 numbers (what peer mode does, in
  63 windows of 64);
* ``bucket``: the vote appended to the first gradient bucket through a Python DDP comm hook;
* ``hook``: the same hook carrying nothing (what a Python comm hook costs by itself);
* ``early``: the vote as its own all-reduce, sent before the forward and read at the step.

Prints each arm's median step and, per cycle, ``restart``'s median step over the arm's with the
95% bootstrap interval of the geometric mean (throughput: 1 is restart mode's).

Measured (three runs on a 2-core machine, 148, 148 and 298 cycles; ``early`` in the last two):
``bucket`` 0.930 [0.907, 0.954], 0.961 [0.937, 0.984], 0.954 [0.937, 0.972]; ``early`` 0.954
[0.928, 0.982], 0.936 [0.919, 0.953]; ``hook`` 0.947 [0.924, 0.971], 1.003 [0.977, 1.030], 0.982
[0.964, 1.000]. Carrying the vote in a gradient bucket through a Python comm hook costs 3-7%, and a
second collective 5-6% even sent before the forward: both more than the five numbers cost on the
step's all-reduce. ``whole`` 0.970 [0.946, 0.995], 0.999 [0.973, 1.027], 1.007 [0.989, 1.024] and
``flag`` 1.008 [0.977, 1.041], 1.008 [0.989, 1.025]: this loop does not resolve the 1-2% that the
five numbers cost inside the worker's window; the measurement that decides between those two is
``benchmarks/peer_steady.py`` (``--keep commit`` prices the vote alone).
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Any

from benchmarks.allreduce_length import VOTE  # the commit vote at W=2, as the step sends it

ARMS = ("restart", "whole", "flag", "bucket", "hook", "early")
SUMMED = [2 * v for v in VOTE]  # what both ranks' identical ballots sum to


class BucketRider:
    """A DDP comm hook that all-reduces each bucket as DDP's built-in one does (multiply by 1/W,
    sum) and, when ``extra`` is set, appends it to bucket 0 and keeps its sum in ``summed``."""

    def __init__(self) -> None:
        self.extra: list[float] | None = None
        self.summed: list[float] | None = None

    def hook(self, state: Any, bucket: Any) -> Any:
        import torch
        import torch.distributed as dist

        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        extra = self.extra if bucket.index() == 0 else None
        if extra is None:
            buffer.mul_(1.0 / group.size())
            future = dist.all_reduce(buffer, group=group, async_op=True).get_future()
            return future.then(lambda f: f.value()[0])
        n = buffer.numel()
        joined = torch.empty(n + len(extra), dtype=buffer.dtype)
        torch.mul(buffer, 1.0 / group.size(), out=joined[:n])
        joined[n:] = torch.tensor(extra, dtype=buffer.dtype)

        def done(fut: Any) -> Any:
            self.summed = joined[n:].tolist()
            return joined[:n]

        return dist.all_reduce(joined, group=group, async_op=True).get_future().then(done)


def worker(iterations: int, block: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.alternating import blocks, dump, new_times
    from worker.start.models import MLP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = MLP(64, 16, hidden=512, depth=4)
    models = {arm: copy.deepcopy(base) for arm in ARMS}
    riders = {arm: BucketRider() for arm in ARMS}
    ddps = {}
    for arm in ARMS:
        ddp = DistributedDataParallel(models[arm], gradient_as_bucket_view=True)
        if arm in ("bucket", "hook"):
            rider = riders[arm]

            def hook(state: Any, bucket: Any, rider: BucketRider = rider) -> Any:
                return rider.hook(state, bucket)

            hook.__annotations__ = {}  # DDP checks annotations against its own types
            ddp.register_comm_hook(None, hook)
        ddps[arm] = ddp
    optimizers = {arm: torch.optim.SGD(models[arm].parameters(), lr=1e-3) for arm in ARMS}
    x, y = torch.randn(64, 64), torch.randn(64, 16)
    times = new_times()
    for cycle, arm in blocks(ARMS, iterations, block):
        ddp, optimizer, rider = ddps[arm], optimizers[arm], riders[arm]
        started = time.perf_counter()
        early = early_work = None
        if arm == "bucket":
            rider.extra, rider.summed = VOTE, None
        elif arm == "early":
            early = torch.tensor(VOTE, dtype=torch.float64)
            early_work = dist.all_reduce(early, async_op=True)
        loss = ((ddp(x) - y) ** 2).sum()
        loss.backward()
        grads = [p.grad for p in models[arm].parameters() if p.grad is not None]
        flag = (torch.stack(torch._foreach_norm(grads)) * 0).sum().double()
        if arm == "flag":
            flag = flag + 1.0  # a request (the worker adds only a nonzero one)
        shared = torch.stack([flag, loss.detach().double()])
        if arm == "whole":
            shared = torch.cat([shared, torch.tensor(VOTE[1:], dtype=torch.float64)])
        dist.all_reduce(shared, async_op=True).wait()
        summed = shared.tolist()
        if arm == "bucket":
            summed += rider.summed or []
        elif early is not None and early_work is not None:
            early_work.wait()
            summed += early.tolist()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times[cycle][arm].append(time.perf_counter() - started)
        if arm in ("bucket", "early"):
            assert summed[2:] == SUMMED, f"{arm}: the vote came back as {summed[2:]}"
    dump(times)
    dist.destroy_process_group()


def main() -> int:
    from benchmarks.alternating import main as run

    title = "one DDP step of the benchmark MLP, 2 gloo processes, one thread each; the vote carried:"
    return run(__doc__ or "", "benchmarks.vote_carrier", worker, arms=ARMS, title=title, throughput=True,
               headline="flag", warm_cycles=2)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
