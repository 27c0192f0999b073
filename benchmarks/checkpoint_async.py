"""Async checkpoints: training blocked per save, and throughput while a save persists.

``python -m benchmarks.checkpoint_async [--mb 200] [--repeats 3]`` (one process, one torch
thread) measures, on an AdamW state of about MB megabytes:

* training blocked per async save as the trainer sees it — ``save()``, the next step's forward
  and backward of the model whose state is saved (the snapshot is copied meanwhile), the fence
  (``wait_snapshot``), the optimizer step; blocked = time in ``save()`` + in the fence — as a
  ratio to a synchronous save of the same state in the same run (target <= 0.06), next to
  ``dcp.async_save``'s call time / ``dcp.save``;
* steps per second of a small MLP idle (no save running), while our async save persists on its
  background thread (snapshot copy, digests, write, fsync, publish), while a separate writer
  process persists the same bytes from shared memory (the alternative the design weighed: no GIL
  shared with training), and while ``dcp.async_save`` (its thread executor) persists the same
  state, each as a ratio to idle (target >= 0.85).

Medians of ``--repeats``. No assertions.
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

from benchmarks.record import emit

ASYNC_BATCH = 32  # rows of the training step between an async save and its fence


def _model(mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The state to checkpoint (a stack of linear layers) and its AdamW optimizer."""
    width = 1024
    layers = max(1, round(mb * (1 << 20) / (3 * 4 * width * width)))
    torch.manual_seed(0)
    big = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(big.parameters(), lr=1e-3)
    big(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return big, opt


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


def _checkpointer(root: Path, *, async_save: bool) -> Any:
    from worker.checkpoint import Checkpointer
    from worker.jobspec.spec import CheckpointSpec, RetentionSpec

    cfg = CheckpointSpec(dir=str(root), async_save=async_save, retention=RetentionSpec(keep_latest=2))
    return Checkpointer(cfg, job="bench", spec_hash="", data_version="", rank=0, world_size=1, generation=0,
                        parallelism="ddp", seed=0, run_record={})  # fmt: skip


def measure_blocking(
    big: nn.Module, opt: torch.optim.Optimizer, repeats: int, root: Path
) -> dict[str, float]:
    """Training blocked per async save vs the synchronous save of the same state, ours and DCP's.

    Ours as the trainer runs it: ``save()``, the next step's forward and backward of ``big`` (the
    model whose state is saved; the snapshot copies meanwhile), the fence, the optimizer step;
    blocked = time in ``save()`` + time in the fence. DCP: the ``dcp.async_save`` call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sync, ck = _checkpointer(root / "sync", async_save=False), _checkpointer(root / "async", async_save=True)
    x = torch.randn(ASYNC_BATCH, big[0].in_features)  # type: ignore[index]
    out: dict[str, list[float]] = {k: [] for k in ("sync", "blocked", "fence", "fwd_bwd", "dcp", "dcp_async")}
    for i in range(repeats + 1):  # round 0 allocates the snapshot buffers and is not counted
        t0 = time.perf_counter()
        sync.save(step=i + 1, model=big, optimizer=opt, progress={}, metrics={})
        t1 = time.perf_counter()
        ck.save(step=i + 1, model=big, optimizer=opt, progress={}, metrics={})
        t2 = time.perf_counter()
        big(x).pow(2).mean().backward()
        t3 = time.perf_counter()
        ck.wait_snapshot()
        t4 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        ck.close()
        msd, osd = get_state_dict(big, opt)
        t5 = time.perf_counter()
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"dcp-sync-{i}"))
        t6 = time.perf_counter()
        fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=str(root / f"dcp-async-{i}"))
        t7 = time.perf_counter()
        fut.result()  # type: ignore[union-attr]
        if i:
            for key, value in (
                ("sync", t1 - t0),
                ("blocked", ck.stats.last_blocking_seconds),
                ("fence", t4 - t3),
                ("fwd_bwd", t3 - t2),
                ("dcp", t6 - t5),
                ("dcp_async", t7 - t6),
            ):
                out[key].append(value)  # fmt: skip
    return {k: statistics.median(v) for k, v in out.items()}


def measure_throughput(
    big: nn.Module, opt: torch.optim.Optimizer, repeats: int, root: Path
) -> dict[str, float]:
    """Steps per second of a small net while a save of ``big`` persists, as ratios to idle."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from worker.checkpoint.blocks import DEFAULT_BLOCK_SIZE

    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    out: dict[str, list[float]] = {"idle": [], "thread": [], "process": [], "dcp_thread": []}
    ck = _checkpointer(root / "ours", async_save=True)
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
        ck.save(step=i + 2, model=big, optimizer=opt, progress={}, metrics={})
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
    med = {k: statistics.median(v) for k, v in out.items()}
    med["persist_s"] = ck.stats.last_persist_seconds
    return med


def main() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    big, opt = _model(args.mb)
    with tempfile.TemporaryDirectory(prefix="elastrain-async-bench-") as root:
        b = measure_blocking(big, opt, args.repeats, Path(root))
        m = measure_throughput(big, opt, args.repeats, Path(root))
    dist.destroy_process_group()
    print(f"state {args.mb} MiB, {args.repeats} saves each (medians)")
    print("training blocked per save / synchronous save of the same state (target <= 0.06):")
    print(f"  ours: save() + fence {b['blocked'] * 1e3:.1f} ms / sync save {b['sync'] * 1e3:.0f} ms "
          f"= {b['blocked'] / b['sync']:.3f}   (fence {b['fence'] * 1e3:.1f} ms after a "
          f"{b['fwd_bwd'] * 1e3:.0f} ms forward+backward of batch {ASYNC_BATCH})")  # fmt: skip
    print(f"  dcp.async_save: {b['dcp_async'] * 1e3:.1f} ms / dcp.save {b['dcp'] * 1e3:.0f} ms "
          f"= {b['dcp_async'] / b['dcp']:.3f}")  # fmt: skip
    print(f"background persist {m['persist_s']:.2f} s")
    print(f"{'throughput while persisting / idle (target >= 0.85)':<52} {'ratio':>6}")
    for key, label in (("thread", "ours, background thread"), ("process", "writer process (shared memory)"),
                       ("dcp_thread", "dcp.async_save (thread)")):  # fmt: skip
        print(f"  {label:<50} {m[key] / m['idle']:>6.3f}")
    print(f"  idle: {m['idle']:.1f} steps/s")
    emit("ours: training blocked per async save / sync save", b["blocked"] / b["sync"], target="<= 0.06",
         spread=f"median of {args.repeats} saves; steps/s while persisting / idle "
         f"{m['thread'] / m['idle']:.3f} (target >= 0.85)")  # fmt: skip


if __name__ == "__main__":
    main()
