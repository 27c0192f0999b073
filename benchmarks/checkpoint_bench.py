"""Checkpoint engine vs plain DCP, side by side in one run; prints ratios (no assertions).

``python -m benchmarks.checkpoint_bench [--mb 200] [--repeats 3] [--load-rounds 7] [--root DIR]``
launches torchrun at W=2 (save, same-W load, async, cold load) on an AdamW state of about MB
megabytes (fp32 params + two moments), then one launch of 3 ranks that loads the W=2 checkpoints
at W' = 2, 3 and 1 interleaved, round after round, and prints:

* durable save throughput: ours (shards + digests + fsync + manifest + rename + latest) vs a raw
  write+fsync of the same bytes by the same ranks;
* save and load time: ours vs ``dcp.save``/``dcp.load`` of the same state (DCP: FileSystemWriter
  with fsync, its default);
* async: training blocked per save vs the synchronous save of the same state in the same run
  (ours: ``save()`` + the fence after the next step's forward/backward; ``dcp.async_save``: the
  call);
* load at W'=3 and W'=1 vs the same-W load (ours and DCP), medians over the rounds and the ratio
  of the fastest rounds, and the bytes and CPU time of the busiest rank; and the floor of those
  ratios for replicated (DDP) state, where every rank must end up holding every byte: plain reads
  of all the shard bytes by each of W' ranks (on a 2-core machine, 3 ranks that each copy N
  bytes take about 1.5x as long as 2 that do, whatever the engine); and the same W'=3 ratio for
  FSDP (sharded) state, from alternating launches of 2 and 3 ranks (``--fsdp-rounds``): each rank
  reads fewer bytes at W'=3, but its fixed work (manifest, plan, state-dict capture and apply,
  about 30 ms at 200 MiB) does not shrink, so three ranks on two cores still pay it 1.5 times;
* cold load vs a cold sequential read (page cache dropped with POSIX_FADV_DONTNEED; on a VM whose
  host caches the disk, "cold" is not really cold: the numbers say so).

Each other number is the median of ``--repeats``. Nothing here is a test; read the ratios.
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
ASYNC_BATCH = 32  # rows per training step between an async save and its fence


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


def _state(mb: int, *, fsdp: bool = False) -> tuple[Any, Any]:
    """An AdamW state of about ``mb`` megabytes; with ``fsdp`` sharded with FSDP2 ``fully_shard``
    over all ranks."""
    import torch
    from torch import nn

    width = 1024
    layers = max(1, round(mb * (1 << 20) / (3 * 4 * width * width)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    if fsdp:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _checkpointer(
    root: Path,
    *,
    rank: int,
    world: int,
    resume: str = "auto",
    async_save: bool = False,
    job: str = "bench",
    parallelism: str = "ddp",
) -> Any:
    from worker.checkpoint import Checkpointer
    from worker.jobspec.spec import CheckpointSpec, RetentionSpec

    cfg = CheckpointSpec(
        dir=str(root), resume=resume, async_save=async_save, retention=RetentionSpec(keep_latest=99)
    )
    return Checkpointer(cfg, job=job, spec_hash="b", data_version="1", rank=rank, world_size=world,
                        generation=0, parallelism=parallelism, seed=0, run_record={})  # fmt: skip


def _load(
    scratch: Path, step_dir: Path, model: Any, opt: Any, *, world: int | None = None, job: str = "bench"
) -> int:
    """Our restore of ``step_dir`` at ``world`` ranks (default: all) as job ``job``, whose own
    checkpoint directory is ``scratch/job`` (a directory belongs to one job); returns this rank's
    bytes read."""
    import torch.distributed as dist

    world = world or dist.get_world_size()
    ck = _checkpointer(scratch / job, rank=dist.get_rank(), world=world, resume=str(step_dir), job=job)
    ck.restore(model=model, optimizer=opt)
    return int(ck.stats.bytes_read_total)


def _dcp_state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _dcp_load(model: Any, opt: Any, path: Path, group: Any = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _dcp_state(model, opt)
    dcp.load(sd, checkpoint_id=str(path), process_group=group)
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
    """Blocking per async save as a trainer sees it: ``save()``, then the next step's forward and
    backward of the model whose state is saved (the snapshot copies meanwhile), then the fence,
    then the optimizer step; blocked = time in ``save()`` + time in the fence."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    ck = _checkpointer(root / "ours-async", rank=rank, world=world, async_save=True)
    x = torch.randn(ASYNC_BATCH, model[0].in_features)
    blocked, fence, fwd_bwd = [], [], []
    for step in range(1, max(reps, 5) + 2):  # the first save allocates the buffers; saves are short
        dist.barrier()
        ck.save(step=step, model=model, optimizer=opt, progress={"samples_seen": 0}, metrics={})
        t0 = time.perf_counter()
        model(x).pow(2).mean().backward()
        t1 = time.perf_counter()
        ck.wait_snapshot()
        fence.append(time.perf_counter() - t1)
        fwd_bwd.append(t1 - t0)
        opt.step()
        opt.zero_grad()
        blocked.append(ck.stats.last_blocking_seconds)
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
        "ours_async_fence_s": statistics.median(fence[1:]),
        "ours_async_fwd_bwd_s": statistics.median(fwd_bwd[1:]),
        "dcp_async_blocked_s": statistics.median(dcp_blocked),
    }


LOAD_WORLDS = (2, 3, 1)  # the same-W load first; the order rotates every round


def worker_loads(args: argparse.Namespace) -> dict[str, Any]:
    """One launch of 3 ranks loads the W=2 checkpoints (ours and DCP's) at W' = 2, 3 and 1,
    interleaved round by round (ranks >= W' wait), so that drift on a shared machine hits every
    W' alike. A load's time is its slowest rank's. Round 0 warms up and is not counted."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    groups = {w: dist.new_group(list(range(w))) for w in sorted(LOAD_WORLDS)}
    root = Path(args.root)
    model, opt = _state(args.mb)
    last = sorted((root / "ours").glob("step-*"))[-1]
    sides = ("ours", "dcp", "raw")
    times: dict[str, list[float]] = {f"{who}_w{w}": [] for who in sides for w in LOAD_WORLDS}
    shards = sorted(last.glob("*.bin"))
    floor_buf = memoryview(bytearray(sum(p.stat().st_size for p in shards)))
    read: dict[str, float] = {}
    cpu: dict[str, list[float]] = {f"w{w}": [] for w in LOAD_WORLDS}
    for rnd in range(args.load_rounds + 1):
        shift = rnd % len(LOAD_WORLDS)
        for w in LOAD_WORLDS[shift:] + LOAD_WORLDS[:shift]:
            for who in sides:
                dist.barrier()
                t0, c0, nbytes = time.perf_counter(), time.process_time(), 0
                if rank < w and who == "ours":
                    nbytes = _load(root / "scratch", last, model, opt, world=w, job=f"load-{rnd}-{w}")
                elif rank < w and who == "dcp":
                    _dcp_load(model, opt, root / "dcp" / "s0", groups[w])
                elif rank < w:
                    _raw_read(shards, floor_buf)
                busy = rank < w
                stats = torch.tensor([time.perf_counter() - t0 if busy else 0.0, float(nbytes),
                                      time.process_time() - c0 if busy else 0.0])  # fmt: skip
                dist.all_reduce(stats, op=dist.ReduceOp.MAX)
                if rnd:
                    times[f"{who}_w{w}"].append(float(stats[0]))
                if who == "ours":
                    read[f"w{w}"] = float(stats[1])
                    cpu[f"w{w}"] += [float(stats[2])] if rnd else []
    return {"times": times, "max_bytes_read_per_rank": read, "max_cpu_s_per_rank": cpu}


def worker_fsdp(args: argparse.Namespace) -> dict[str, Any]:
    """FSDP (sharded state): save once at W=2 (``--fsdp-save``), or load that checkpoint
    ``--repeats`` times at this launch's world size; a load's time is its slowest rank's."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.root) / "fsdp"
    model, opt = _state(args.mb, fsdp=True)
    if args.fsdp_save:
        ck = _checkpointer(root, rank=rank, world=world, parallelism="fsdp")
        ck.save(step=1, model=model, optimizer=opt, progress={"samples_seen": 0}, metrics={})
        ck.close()
        return {}
    last = sorted(root.glob("step-*"))[-1]
    times, nbytes = [], 0.0
    for i in range(args.repeats + 1):  # the first load warms up
        job = f"fsdp-{world}-{i}"
        ck = _checkpointer(Path(args.root) / "fsdp-scratch" / job, rank=rank, world=world, resume=str(last),
                           job=job, parallelism="fsdp")  # fmt: skip
        dist.barrier()
        t0 = time.perf_counter()
        ck.restore(model=model, optimizer=opt)
        stats = torch.tensor([time.perf_counter() - t0, float(ck.stats.bytes_read_total)])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(stats[0]))
        nbytes = float(stats[1])
    return {"load_s": statistics.median(times), "max_bytes_read_per_rank": nbytes}


def _fsdp_rows(args: argparse.Namespace) -> list[tuple[str, float, str, str]]:
    """Launches alternating W'=2 and W'=3 FSDP loads of a W=2 FSDP checkpoint, ``--fsdp-rounds``
    times; the ratio of the medians."""
    _launch(2, "fsdp", args, extra=["--fsdp-save"])
    by_world: dict[int, list[float]] = {2: [], 3: []}
    read: dict[int, float] = {}
    for rnd in range(args.fsdp_rounds):
        for w in (2, 3) if rnd % 2 == 0 else (3, 2):
            res = _launch(w, "fsdp", args)
            by_world[w].append(res["load_s"])
            read[w] = res["max_bytes_read_per_rank"]
    ratio = statistics.median(by_world[3]) / statistics.median(by_world[2])
    note = (f"FSDP (sharded); busiest rank read {read[2] / (1 << 20):.0f} MiB at W'=2, "
            f"{read[3] / (1 << 20):.0f} MiB at W'=3; {args.fsdp_rounds} alternating launches")  # fmt: skip
    return [("load W'=3 / same-W load (ours, fsdp)", ratio, "<= 1.2", note)]


def _raw_read(files: list[Path], into: memoryview) -> None:
    """The floor of a replicated (DDP) load: copy every byte of the checkpoint's shards into this
    rank's memory with plain reads; no manifest, no digests, no placement into tensors."""
    pos = 0
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while got := f.readinto(into[pos : pos + (16 << 20)]):
                pos += got


def _launch(
    nproc: int, phase: str, args: argparse.Namespace, extra: list[str] | None = None
) -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    result = Path(args.root) / f"result-{phase}-{nproc}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", phase, "--root", args.root, "--mb", str(args.mb), "--repeats",
           str(args.repeats), "--load-rounds", str(args.load_rounds), "--result", str(result),
           *(extra or [])]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, cwd=REPO)
    return dict(json.loads(result.read_text()))


def _load_rows(loads: dict[str, Any]) -> list[tuple[str, float, str, str]]:
    """W' / same-W ratios of the interleaved loads: the ratio of the medians over rounds, the
    median of the per-round ratios (loads of one round ran back to back) and the ratio of the
    fastest rounds."""
    t = loads["times"]
    rows = []
    for w, target, dcp_note in ((3, "<= 1.2", "; DCP ~1.69"), (1, "<= 1.1", "; DCP ~1.24")):
        for who in ("ours", "dcp", "raw"):
            new, same = t[f"{who}_w{w}"], t[f"{who}_w2"]
            ratio = statistics.median(new) / statistics.median(same)
            paired = statistics.median(a / b for a, b in zip(new, same, strict=True))
            note = f"per round {paired:.3f}, min/min {min(new) / min(same):.3f}, {len(new)} rounds"
            extra = {"dcp": dcp_note, "raw": "; the floor: plain reads of all shard bytes"}.get(who, "")
            rows.append((f"load W'={w} / same-W load ({who}, median)", ratio, target if who == "ours" else "",
                         note + extra))  # fmt: skip
    return rows


def _report(
    w2: dict[str, float], loads: dict[str, Any], fsdp: list[tuple[str, float, str, str]], repeats: int
) -> None:
    mb = w2["bytes_total"] / (1 << 20)
    rows = [
        ("state size (MiB)", mb, "", ""),
        ("durable save throughput / raw write+fsync", w2["raw_write_fsync_s"] / w2["ours_save_s"],
         ">= 0.9", ""),
        ("save time ours / dcp.save", w2["ours_save_s"] / w2["dcp_save_s"], "<= 1.0", ""),
        ("load time ours / dcp.load (W=2)", w2["ours_load_s"] / w2["dcp_load_s"], "<= 1.0", ""),
        ("async blocked / sync save (ours)", w2["ours_async_blocked_s"] / w2["ours_save_s"], "<= 0.06",
         f"save()+fence; fence {w2['ours_async_fence_s'] * 1e3:.1f} ms after a "
         f"{w2['ours_async_fwd_bwd_s'] * 1e3:.0f} ms fwd+bwd"),
        ("async blocked / sync save (dcp.async_save)", w2["dcp_async_blocked_s"] / w2["dcp_save_s"], "",
         "DCP ~0.28"),
        *_load_rows(loads),
        *fsdp,
        ("cold load throughput / cold sequential read", w2["cold_sequential_read_s"] / w2["ours_cold_load_s"],
         ">= 0.6", "see docstring"),
    ]  # fmt: skip
    print(f"{'measure':<46} {'value':>8}  {'target':<8} note")
    for name, value, target, note in rows:
        print(f"{name:<46} {value:>8.3f}  {target:<8} {note}")
    size = w2["bytes_total"]
    for w, nbytes in sorted(loads["max_bytes_read_per_rank"].items()):
        cpu_ms = statistics.median(loads["max_cpu_s_per_rank"][w]) * 1e3
        print(f"  {w}: the busiest rank read {nbytes / size:.3f}x the state's bytes (DDP: every rank needs "
              f"all), CPU {cpu_ms:.0f} ms per load (median); {os.cpu_count()} cores")  # fmt: skip
    print(json.dumps({"w2": w2, "loads": loads}, indent=1))
    from benchmarks.record import emit

    others = (f"save / dcp.save {w2['ours_save_s'] / w2['dcp_save_s']:.3f}, "
              f"load / dcp.load {w2['ours_load_s'] / w2['dcp_load_s']:.3f}")  # fmt: skip
    emit("durable save throughput / raw write+fsync", w2["raw_write_fsync_s"] / w2["ours_save_s"],
         target=">= 0.9", spread=f"median of {repeats} saves of {mb:.0f} MiB; {others}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load-rounds", type=int, default=7)
    parser.add_argument("--root", default="")
    parser.add_argument("--fsdp-rounds", type=int, default=4, help="alternating W'=2/3 FSDP load launches")
    parser.add_argument("--fsdp-save", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["save", "loads", "fsdp"])
    parser.add_argument("--result", default="")
    args = parser.parse_args()
    if args.worker:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        work = {"save": worker_save, "loads": worker_loads, "fsdp": worker_fsdp}[args.worker]
        res = work(args)
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps(res))
        dist.destroy_process_group()
        return
    owned = not args.root
    args.root = args.root or tempfile.mkdtemp(prefix="elastrain-ckpt-bench-")
    try:
        w2 = _launch(2, "save", args)
        loads = _launch(max(LOAD_WORLDS), "loads", args)
        fsdp = _fsdp_rows(args) if args.fsdp_rounds else []
        _report(w2, loads, fsdp, args.repeats)
    finally:
        if owned:
            shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
