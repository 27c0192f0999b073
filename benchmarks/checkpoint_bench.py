"""Checkpoint engine vs plain DCP, side by side in one run; prints ratios (no assertions).

``python -m benchmarks.checkpoint_bench [--mb 200] [--repeats 3] [--root DIR]`` launches torchrun
at W=2 (save, same-W load, async, cold load), then W'=3 and W'=1 (resharding loads) on the same
AdamW state of about MB megabytes (fp32 params + two moments), and prints:

* durable save throughput: ours (shards + digests + fsync + manifest + rename + latest) vs a raw
  write+fsync of the same bytes by the same ranks;
* save and load time: ours vs ``dcp.save``/``dcp.load`` of the same state (DCP: FileSystemWriter
  with fsync, its default);
* async: training blocked per save vs the synchronous save (ours and ``dcp.async_save``);
* load at W'=3 and W'=1 vs the same-W load (ours and DCP);
* cold load vs a cold sequential read (page cache dropped with POSIX_FADV_DONTNEED; on a VM whose
  host caches the disk, "cold" is not really cold: the numbers say so).

Each number is the median of ``--repeats``. Nothing here is a test; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _median_time(fn: Callable[[], object], repeats: int, barrier: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _evict(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def _state(mb: int) -> tuple[Any, Any]:
    import torch
    from torch import nn

    width = 1024
    layers = max(1, round(mb * (1 << 20) / (3 * 4 * width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _checkpointer(
    root: Path, *, rank: int, world: int, resume: str = "auto", async_save: bool = False
) -> Any:
    from worker.checkpoint import Checkpointer
    from worker.spec import CheckpointSpec, RetentionSpec

    cfg = CheckpointSpec(
        dir=str(root), resume=resume, async_save=async_save, retention=RetentionSpec(keep_latest=99)
    )
    return Checkpointer(cfg, job="bench", spec_hash="b", data_version="1", rank=rank, world_size=world,
                        generation=0, parallelism="ddp", seed=0, run_record={})  # fmt: skip


def _load(scratch: Path, step_dir: Path, model: Any, opt: Any) -> None:
    import torch.distributed as dist

    ck = _checkpointer(scratch, rank=dist.get_rank(), world=dist.get_world_size(), resume=str(step_dir))
    ck.restore(model=model, optimizer=opt)


def _dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _dcp_load(model: Any, opt: Any, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def worker_save(args: argparse.Namespace) -> dict[str, float]:
    """W=2: raw vs ours vs DCP save, same-W loads, async blocking, cold load."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank, world = dist.get_rank(), dist.get_world_size()
    root, reps = Path(args.root), args.repeats
    model, opt = _state(args.mb)
    out: dict[str, float] = {}
    ck = _checkpointer(root / "ours", rank=rank, world=world)
    steps = iter(range(1, 1000))

    def save() -> None:
        ck.save(step=next(steps), model=model, optimizer=opt, progress={"samples_seen": 0}, metrics={})

    out["ours_save_s"] = _median_time(save, reps, dist.barrier)
    mine = root / "ours" / "step-00000001" / f"rank-{rank:05d}.bin"
    out["bytes_total"] = float(sum(p.stat().st_size for p in (root / "ours" / "step-00000001").glob("*.bin")))
    payload = os.urandom(mine.stat().st_size)

    def raw() -> None:
        p = root / "raw" / f"{time.monotonic_ns()}-{rank}"
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    out["raw_write_fsync_s"] = _median_time(raw, reps, dist.barrier)
    counter = iter(range(1000))
    out["dcp_save_s"] = _median_time(
        lambda: dcp.save(_dcp_state(model, opt), checkpoint_id=str(root / "dcp" / f"s{next(counter)}")),
        reps,
        dist.barrier,
    )
    last = sorted((root / "ours").glob("step-*"))[-1]
    out["ours_load_s"] = _median_time(lambda: _load(root / "scratch", last, model, opt), reps, dist.barrier)
    out["dcp_load_s"] = _median_time(lambda: _dcp_load(model, opt, root / "dcp" / "s0"), reps, dist.barrier)
    out.update(_async(model, opt, root, rank, world, reps))
    files = _files(last)

    def cold_ours() -> None:
        _evict(files)
        _load(root / "scratch", last, model, opt)

    def cold_read() -> None:
        _evict(files)
        for p in files:
            with open(p, "rb") as f:
                while f.read(16 << 20):
                    pass

    out["ours_cold_load_s"] = _median_time(cold_ours, reps, dist.barrier)
    out["cold_sequential_read_s"] = _median_time(cold_read, reps, dist.barrier)
    return out


def _async(model: Any, opt: Any, root: Path, rank: int, world: int, reps: int) -> dict[str, float]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    ck = _checkpointer(root / "ours-async", rank=rank, world=world, async_save=True)
    blocked = []
    for step in range(1, reps + 2):  # the first save allocates the buffers
        dist.barrier()
        t0 = time.perf_counter()
        ck.save(step=step, model=model, optimizer=opt, progress={"samples_seen": 0}, metrics={})
        blocked.append(time.perf_counter() - t0)
        ck.close()
    dcp_blocked = []
    for i in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fut = dcp.async_save(_dcp_state(model, opt), checkpoint_id=str(root / "dcp-async" / f"s{i}"))
        dcp_blocked.append(time.perf_counter() - t0)
        fut.result()  # type: ignore[union-attr]  # a Future unless async_stager is given
    return {
        "ours_async_blocked_s": statistics.median(blocked[1:]),
        "dcp_async_blocked_s": statistics.median(dcp_blocked),
    }


def worker_load(args: argparse.Namespace) -> dict[str, float]:
    """W' != 2: load the W=2 checkpoints (ours and DCP's)."""
    import torch.distributed as dist

    root = Path(args.root)
    model, opt = _state(args.mb)
    last = sorted((root / "ours").glob("step-*"))[-1]
    scratch = root / f"scratch{dist.get_world_size()}"
    ours = _median_time(lambda: _load(scratch, last, model, opt), args.repeats, dist.barrier)
    theirs = _median_time(lambda: _dcp_load(model, opt, root / "dcp" / "s0"), args.repeats, dist.barrier)
    return {"ours_load_s": ours, "dcp_load_s": theirs}


def _launch(nproc: int, phase: str, args: argparse.Namespace) -> dict[str, float]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    result = Path(args.root) / f"result-{phase}-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", phase, "--root", args.root, "--mb", str(args.mb),
           "--repeats", str(args.repeats), "--result", str(result)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, cwd=REPO)
    return dict(json.loads(result.read_text()))


def _report(w2: dict[str, float], w3: dict[str, float], w1: dict[str, float]) -> None:
    mb = w2["bytes_total"] / (1 << 20)
    rows = [
        ("state size (MiB)", mb, "", ""),
        ("durable save throughput / raw write+fsync", w2["raw_write_fsync_s"] / w2["ours_save_s"],
         ">= 0.9", ""),
        ("save time ours / dcp.save", w2["ours_save_s"] / w2["dcp_save_s"], "<= 1.0", ""),
        ("load time ours / dcp.load (W=2)", w2["ours_load_s"] / w2["dcp_load_s"], "<= 1.0", ""),
        ("async blocked / sync save (ours)", w2["ours_async_blocked_s"] / w2["ours_save_s"], "<= 0.06", ""),
        ("async blocked / sync save (dcp)", w2["dcp_async_blocked_s"] / w2["dcp_save_s"], "", "DCP ~0.28"),
        ("load W'=3 / same-W load (ours)", w3["ours_load_s"] / w2["ours_load_s"], "<= 1.2", ""),
        ("load W'=3 / same-W load (dcp)", w3["dcp_load_s"] / w2["dcp_load_s"], "", "DCP ~1.69"),
        ("load W'=1 / same-W load (ours)", w1["ours_load_s"] / w2["ours_load_s"], "<= 1.1", ""),
        ("load W'=1 / same-W load (dcp)", w1["dcp_load_s"] / w2["dcp_load_s"], "", "DCP ~1.24"),
        ("cold load throughput / cold sequential read", w2["cold_sequential_read_s"] / w2["ours_cold_load_s"],
         ">= 0.6", "see docstring"),
    ]  # fmt: skip
    print(f"{'measure':<46} {'value':>8}  {'target':<8} note")
    for name, value, target, note in rows:
        print(f"{name:<46} {value:>8.3f}  {target:<8} {note}")
    print(json.dumps({"w2": w2, "w3": w3, "w1": w1}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", default="")
    parser.add_argument("--worker", choices=["save", "load"])
    parser.add_argument("--result", default="")
    args = parser.parse_args()
    if args.worker:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        res = worker_save(args) if args.worker == "save" else worker_load(args)
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps(res))
        dist.destroy_process_group()
        return
    owned = not args.root
    args.root = args.root or tempfile.mkdtemp(prefix="elastrain-ckpt-bench-")
    try:
        w2 = _launch(2, "save", args)
        w3 = _launch(3, "load", args)
        w1 = _launch(1, "load", args)
        _report(w2, w3, w1)
    finally:
        if owned:
            shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
