"""Training throughput while a checkpoint is written in the background: thread vs process vs DCP.

``python -m benchmarks.checkpoint_async [--mb 200] [--repeats 3]`` trains a small MLP (one
process, one torch thread) and measures steps per second

* idle (no save running),
* while our async save persists on its background thread (snapshot, then digests + write +
  fsync + publish),
* while a separate writer process persists the same bytes from shared memory (the alternative
  the design weighed: no GIL shared with training),
* while ``dcp.async_save`` (its thread executor) persists the same state,

and prints each as a ratio to idle, plus the time training was blocked per save. No assertions.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _model(mb: int) -> tuple[nn.Module, torch.optim.Optimizer, nn.Module]:
    """(big state to checkpoint, its optimizer, a small net that trains)."""
    width = 1024
    layers = max(1, round(mb * (1 << 20) / (3 * 4 * width * width)))
    torch.manual_seed(0)
    big = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(big.parameters(), lr=1e-3)
    big(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return big, opt, nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))


def _train_until(net: nn.Module, done: Callable[[], bool], min_steps: int = 5) -> float:
    """Steps per second of a training loop that runs until ``done()`` (at least ``min_steps``)."""
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    x = torch.randn(64, 256)
    steps, t0 = 0, time.perf_counter()
    while steps < min_steps or not done():
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        steps += 1
    return steps / (time.perf_counter() - t0)


def _writer_process(conn: Any, shared: list[torch.Tensor], block_size: int) -> None:
    from worker.checkpoint.saveplan import Assignment
    from worker.checkpoint.shardio import write_shard
    from worker.checkpoint.state import byte_view

    while True:
        path = conn.recv()
        if path is None:
            return
        items = [(Assignment(f"t{i}", 0, t.shape[0]), byte_view(t)) for i, t in enumerate(shared)]
        write_shard(Path(path), items, block_size=block_size)
        conn.send("done")


def measure(mb: int, repeats: int, root: Path) -> dict[str, float]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from worker.checkpoint import Checkpointer
    from worker.checkpoint.blocks import DEFAULT_BLOCK_SIZE
    from worker.spec import CheckpointSpec, RetentionSpec

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    big, opt, net = _model(mb)
    out: dict[str, list[float]] = {"idle": [], "thread": [], "process": [], "dcp_thread": [], "blocked": []}
    cfg = CheckpointSpec(dir=str(root / "ours"), async_save=True, retention=RetentionSpec(keep_latest=2))
    ck = Checkpointer(cfg, job="bench", spec_hash="", data_version="", rank=0, world_size=1, generation=0,
                      parallelism="ddp", seed=0, run_record={})  # fmt: skip
    shared = [t.detach().clone().share_memory_() for t in big.state_dict().values()]
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_writer_process, args=(child, shared, DEFAULT_BLOCK_SIZE), daemon=True)
    proc.start()
    ck.save(step=1, model=big, optimizer=opt, progress={}, metrics={})  # allocate the snapshot buffers
    ck.close()
    for i in range(repeats):
        until = time.perf_counter() + 1.0
        out["idle"].append(_train_until(net, lambda: time.perf_counter() > until))  # noqa: B023
        t0 = time.perf_counter()
        ck.save(step=i + 2, model=big, optimizer=opt, progress={}, metrics={})
        out["blocked"].append(time.perf_counter() - t0)
        out["thread"].append(_train_until(net, lambda: not ck._writer.in_flight))
        ck.close()
        parent.send(str(root / f"proc-{i}.bin"))
        out["process"].append(_train_until(net, parent.poll))
        parent.recv()
        msd, osd = get_state_dict(big, opt)
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"dcp-{i}"))
        out["dcp_thread"].append(_train_until(net, fut.done))  # type: ignore[union-attr]
    parent.send(None)
    proc.join()
    dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in out.items()}
    med["persist_s"] = ck.stats.last_persist_seconds
    return med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="elastrain-async-bench-") as root:
        m = measure(args.mb, args.repeats, Path(root))
    print(f"state {args.mb} MiB, background persist {m['persist_s']:.2f} s, blocked {m['blocked']:.4f} s")
    print(f"{'throughput while persisting / idle':<44} {'ratio':>6}")
    for key, label in (("thread", "ours, background thread"), ("process", "writer process (shared memory)"),
                       ("dcp_thread", "dcp.async_save (thread)")):  # fmt: skip
        print(f"  {label:<42} {m[key] / m['idle']:>6.3f}")
    print(f"  idle: {m['idle']:.1f} steps/s")


if __name__ == "__main__":
    main()
