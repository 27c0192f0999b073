"""Where slow batches are best prepared on this machine: the worker's background thread, or
DataLoader-style worker processes? Measured side by side in one run (the choice behind
:mod:`worker.datapath.feed`).

One torchrun launch per kind of cost (``io``: waiting; ``cpu``: computing, see
:mod:`benchmarks.slow_data`); in it every rank trains the benchmark MLP under DDP (as
:mod:`benchmarks.bare_ddp` does) in segments of ``--steps`` steps, rotating through: free data;
slow data loaded on the training thread; loaded ahead on one thread (``worker.datapath.feed.PrefetchFeed``,
2 micro-batches deep); loaded ahead by ``torch.utils.data.DataLoader`` worker processes
(``--procs``, prefetch factor 2, persistent). The same micro-batches in the same order everywhere;
a slow ``batch()`` costs half the free step. Prints steps/s of each against free data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from typing import Any

from benchmarks.record import emit
from benchmarks.worker_throughput import _torchrun

VARIANTS = ("free", "inline", "thread", "processes")


def _child(kind: str, steps: int, rounds: int, procs: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from benchmarks.slow_data import slow
    from worker.datapath.datasets import loss_sum, synthetic
    from worker.datapath.feed import Feed, PrefetchFeed
    from worker.datapath.sampler import SamplerState
    from worker.jobspec.spec import ModelSpec
    from worker.start.models import build_model

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    free = synthetic(65536, 0, input_dim=128)
    costly = slow(65536, 0, input_dim=128, kind=kind, cost_ms=0.0)
    model = DDP(build_model(ModelSpec(name="mlp", kwargs={"hidden": 512, "depth": 4}), free.meta),
                gradient_as_bucket_view=True)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cpu = torch.device("cpu")
    common: dict[str, Any] = dict(
        seed=0, rank=rank, world_size=world, micro_batch=64, accum_steps=2, device=cpu
    )

    def micro_batches(variant: str, state: SamplerState) -> Iterator[tuple[Any, Any]]:
        if variant in ("free", "inline", "thread"):
            feed = PrefetchFeed(costly, depth=2, **common) if variant == "thread" else (
                Feed(free if variant == "free" else costly, **common))  # fmt: skip
            try:
                while True:
                    window = feed.plan(state)
                    for m in feed.batches(state, window):
                        yield m.inputs, m.targets
                    state = window.after
            finally:
                feed.close()
        plan, keys = Feed(costly, **common), []
        for _ in range(steps + 1):
            window = plan.plan(state)
            keys += [(window, j) for j in range(len(window.micro_steps))]
            state = window.after
        loader = DataLoader(_Loads(plan, keys), batch_size=None, num_workers=procs, prefetch_factor=2,
                            persistent_workers=True)  # fmt: skip
        for m in loader:
            yield m.inputs, m.targets

    def segment(variant: str) -> float:
        batches = micro_batches(variant, SamplerState())
        started = 0.0
        for step in range(steps + 1):
            if step == 1:  # after one step: the loader has started (processes forked)
                started = time.perf_counter()
            for micro in range(2):
                x, y = next(batches)
                sync = contextlib.nullcontext() if micro == 1 else model.no_sync()
                with sync:
                    (loss_sum(free.task, model(x), y) / 128).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        batches.close()
        return steps / (time.perf_counter() - started)

    calibration = torch.tensor([1.0 / segment("free")])
    dist.all_reduce(calibration, op=dist.ReduceOp.MAX)
    costly.cost_s = float(calibration) / 2 / 2  # half the free step, over 2 micro-batches
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(rounds):
        for variant in VARIANTS[i % 4 :] + VARIANTS[: i % 4]:
            rates[variant].append(segment(variant))
    if rank == 0:
        print(json.dumps({"kind": kind, "cost_ms": costly.cost_s * 1000, "rates": rates}), flush=True)
    dist.destroy_process_group()


class _Loads:
    """A map-style dataset of planned micro-batches, for DataLoader worker processes."""

    def __init__(self, feed: Any, keys: list[Any]) -> None:
        self.feed, self.keys = feed, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> Any:
        window, micro = self.keys[i]
        return self.feed.load(window, micro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--procs", type=int, default=2, help="DataLoader worker processes per rank")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    thread: dict[str, list[float]] = {}
    for kind in ("io", "cpu"):
        child = [
            "-m",
            "benchmarks.loader_choice",
            "--child",
            kind,
            *map(str, (args.steps, args.rounds, args.procs)),
        ]
        out = _torchrun(args.nproc, *child, timeout=None)
        result = json.loads(out.strip().splitlines()[-1])
        free = statistics.median(result["rates"]["free"])
        print(f"{kind}: batch() costs {result['cost_ms']:.1f} ms (half the free step over 2 micro-batches)")
        for variant, values in result["rates"].items():
            print(
                f"  {variant:<10} steps/s {statistics.median(values):6.1f} (min {min(values):.1f}, max "
                f"{max(values):.1f})  / free {statistics.median(values) / free:.3f}"
            )
        rates = result["rates"]
        thread[kind] = [t / f for t, f in zip(rates["thread"], rates["free"], strict=True)]
    print(f"load average (1 min) before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    emit("io: loader thread / free steps/s, median of the rounds' ratios (no target: a choice)",
         statistics.median(thread["io"]), rounds=thread["io"])  # fmt: skip
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        sys.exit(0)
    sys.exit(main())
