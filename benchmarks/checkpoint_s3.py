"""Checkpoints on S3 vs DCP on the same server, side by side in one run; prints ratios (no assertions).

``python -m benchmarks.checkpoint_s3 [--mb 200] [--rounds 5] [--async-saves 4]`` starts one
SeaweedFS (``weed mini``, as the tests do), then torchrun at W=2 on gloo with an AdamW state of
about MB megabytes (fp32 params + two moments), and measures against that one server:

* save and load time: ours (shards uploaded multipart in parallel with block digests, the
  manifest created last, ``latest`` moved) vs ``dcp.save``/``dcp.load`` through DCP's fsspec
  writer and reader over s3fs (its defaults: one writer thread per rank; ``sync_files`` off,
  since a finished PUT is durable and DCP would otherwise call ``os.sync()`` per file); the
  arms alternate in every round and the order rotates, so drift on a shared machine hits both;
* training blocked per async save to S3 (``save()`` + the fence after the next step's forward
  and backward) vs the synchronous saves of the same run;
* peak memory during a save: the growth of each rank's peak RSS (``VmHWM``, reset through
  ``/proc/self/clear_refs`` before the save) vs the bytes that rank saves plus two upload parts,
  for a synchronous save, an async save (snapshot and persist) and ``dcp.save``;
* then one launch of 3 ranks loads the W=2 checkpoints at W'=3 and W'=2, interleaved round by
  round (ranks >= W' wait): ours, DCP's, and the floor (plain reads of every shard object by each
  rank: with DDP every rank must end up holding every byte).

Round 0 warms up (connections, imports) and is not counted. Medians over the rounds, the
per-round ratios' median and range.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.checkpoint_bench import _checkpointer, _dcp_state, _load, _state
from benchmarks.stats import rotation, spread

REPO = Path(__file__).resolve().parents[1]
BUCKET = "ckpt"
ASYNC_BATCH = 32  # rows per training step between an async save and its fence
LOAD_WORLDS = (2, 3)


def _loc(name: str) -> Any:
    from worker.jobspec.location import S3Location

    return S3Location(BUCKET, f"bench/{name}")


def _timed(fn: Callable[[], object]) -> float:
    """Barrier to barrier: the slowest rank's time."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _save(ck: Any, model: Any, opt: Any, step: int) -> None:
    ck.save(step=step, model=model, optimizer=opt, progress={"samples_seen": 0}, metrics={})


def _idle() -> None:
    """A rank outside the loading world."""


def _round(arms: dict[str, Callable[[], object]], rnd: int, times: dict[str, list[float]]) -> None:
    """One round of the arms, each first in turn; round 0 warms up and is not counted."""
    for name in rotation(tuple(arms), rnd):
        took = _timed(arms[name])
        if rnd:
            times[name].append(took)


def _dcp_save(model: Any, opt: Any, url: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(_dcp_state(model, opt), storage_writer=FsspecWriter(url, sync_files=False))


def _dcp_load(model: Any, opt: Any, url: str, group: Any = None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _dcp_state(model, opt)
    dcp.load(sd, storage_reader=FsspecReader(url), process_group=group)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _peak_growth(fn: Callable[[], object]) -> float:
    """Bytes by which this process's peak RSS rose above its RSS while ``fn`` ran (the peak is
    reset through ``/proc/self/clear_refs``, Linux; freed heap pages are first returned with
    glibc's ``malloc_trim``, so that a save reusing them still counts)."""

    def status(field: str) -> int:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(line.split()[1]) << 10 for line in f if line.startswith(field))

    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages out of the baseline
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
    before = status("VmRSS:")
    fn()
    return float(status("VmHWM:") - before)


def _max(*values: float) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t]


def worker_save(args: argparse.Namespace) -> dict[str, Any]:
    """W=2: interleaved rounds of our save and load vs DCP's; async blocking; peak memory."""
    import torch.distributed as dist

    from worker.checkpoint.remote import object_sizes

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _state(args.mb)
    scratch = Path(args.scratch)
    ours = _loc("ours")
    ck = _checkpointer(ours, rank=rank, world=world)
    times: dict[str, list[float]] = {k: [] for k in ("ours_save", "dcp_save", "ours_load", "dcp_load")}
    for rnd in range(args.rounds + 1):
        step, url = rnd + 1, f"s3://{BUCKET}/bench/dcp/r{rnd}"
        saves = {
            "ours_save": partial(_save, ck, model, opt, step),
            "dcp_save": partial(_dcp_save, model, opt, url),
        }
        loads = {"ours_load": partial(_load, scratch, ours / f"step-{step:08d}", model, opt, job=f"l{rnd}"),
                 "dcp_load": partial(_dcp_load, model, opt, url)}  # fmt: skip
        for arms in (saves, loads):
            _round(arms, rnd, times)
    last = ours / f"step-{args.rounds + 1:08d}"
    mine = float(object_sizes(last)[f"rank-{rank:05d}.bin"])
    total = float(sum(v for k, v in object_sizes(last).items() if k.endswith(".bin")))
    out: dict[str, Any] = {"times": times, "bytes_total": total}
    out.update(_async(model, opt, rank, world, args.async_saves))
    step = args.rounds + 2
    sync_peak = _peak_growth(partial(_save, ck, model, opt, step))
    ck.close()
    dcp_peak = _peak_growth(lambda: _dcp_save(model, opt, f"s3://{BUCKET}/bench/dcp/mem"))
    ack = _checkpointer(_loc("async-mem"), rank=rank, world=world, async_save=True)

    def async_save() -> None:
        _save(ack, model, opt, 1)
        ack.close()  # waits for the snapshot and the upload

    async_peak = _peak_growth(async_save)
    # the peaks of the rank with the largest share, beside what that rank saves
    out["peak"] = dict(zip(("sync", "async", "dcp", "rank_bytes"),
                           _max(sync_peak, async_peak, dcp_peak, mine), strict=True))  # fmt: skip
    return out


def _async(model: Any, opt: Any, rank: int, world: int, saves: int) -> dict[str, Any]:
    """Training blocked per async save as a trainer sees it: ``save()``, the next step's forward
    and backward (the snapshot copies meanwhile), the fence, the optimizer step; blocked = time
    in ``save()`` + in the fence. The first save allocates the snapshot buffers: not counted."""
    import torch
    import torch.distributed as dist

    ck = _checkpointer(_loc("async"), rank=rank, world=world, async_save=True)
    x = torch.randn(ASYNC_BATCH, model[0].in_features)
    blocked = []
    for step in range(1, saves + 2):
        dist.barrier()
        _save(ck, model, opt, step)
        model(x).pow(2).mean().backward()
        ck.wait_snapshot()
        opt.step()
        opt.zero_grad()
        blocked.append(ck.stats.last_blocking_seconds)
        ck.close()
    return {"async_blocked": _max(*blocked[1:])}


def worker_loads(args: argparse.Namespace) -> dict[str, Any]:
    """3 ranks load the W=2 checkpoints at W' = 2 and 3, interleaved round by round; a load's
    time is its slowest rank's."""
    import torch.distributed as dist

    from worker.checkpoint.remote import object_sizes, resolve_checkpoint
    from worker.checkpoint.storage import storage_for

    rank = dist.get_rank()
    groups = {w: dist.new_group(list(range(w))) for w in LOAD_WORLDS}
    model, opt = _state(args.mb)
    step = resolve_checkpoint(_loc("ours"))
    shards = [step.key(n) for n in sorted(object_sizes(step)) if n.endswith(".bin")]
    url = f"s3://{BUCKET}/bench/dcp/r{args.rounds}"

    def raw() -> None:
        for key in shards:
            storage_for(step).read(key)

    times: dict[str, list[float]] = {f"{who}_w{w}": [] for who in ("ours", "dcp", "raw") for w in LOAD_WORLDS}
    for rnd in range(args.rounds + 1):
        for w in rotation(LOAD_WORLDS, rnd):
            arms: dict[str, Callable[[], object]] = {
                f"ours_w{w}": partial(
                    _load, Path(args.scratch), step, model, opt, world=w, job=f"l{rnd}-{w}"
                ),
                f"dcp_w{w}": partial(_dcp_load, model, opt, url, groups[w]),
                f"raw_w{w}": raw,
            }
            _round(arms if rank < w else {k: _idle for k in arms}, rnd, times)
    return {"times": times}


def _launch(nproc: int, phase: str, args: argparse.Namespace) -> dict[str, Any]:
    result = Path(args.scratch) / f"result-{phase}.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           __file__, "--worker", phase, "--mb", str(args.mb), "--rounds", str(args.rounds), "--async-saves",
           str(args.async_saves), "--scratch", args.scratch, "--result", str(result)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, cwd=REPO)
    return dict(json.loads(result.read_text()))


def _pair(new: list[float], base: list[float]) -> tuple[float, list[float]]:
    """The ratio of the medians and the per-round ratios."""
    return statistics.median(new) / statistics.median(base), [a / b for a, b in zip(new, base, strict=True)]


def _report(w2: dict[str, Any], loads: dict[str, Any]) -> None:
    from benchmarks.record import emit
    from worker.checkpoint.storage import PART_SIZE

    t, lt, mib = w2["times"], loads["times"], 1 << 20
    rows: list[tuple[str, float, list[float], str, str]] = []
    for what in ("save", "load"):
        ratio, per = _pair(t[f"ours_{what}"], t[f"dcp_{what}"])
        note = f"ours {spread(t[f'ours_{what}'])} s, DCP {spread(t[f'dcp_{what}'])} s"
        rows.append((f"{what} time ours / DCP (fsspec+s3fs)", ratio, per, "<= 0.7", note))
    for who in ("ours", "dcp", "raw"):
        ratio, per = _pair(lt[f"{who}_w3"], lt[f"{who}_w2"])
        note = f"W'=3 {spread(lt[f'{who}_w3'])} s, W'=2 {spread(lt[f'{who}_w2'])} s"
        target = "<= 1.1" if who == "ours" else ""
        rows.append((f"load W'=3 / same-W load ({who})", ratio, per, target, note))
    sync = statistics.median(t["ours_save"])
    blocked = w2["async_blocked"]
    note = f"blocked {spread([b * 1e3 for b in blocked])} ms"
    rows.append(("async blocked / sync save (ours, S3)", statistics.median(blocked) / sync,
                 [b / sync for b in blocked], "<= 0.02", note))  # fmt: skip
    peak = w2["peak"]
    bound = peak["rank_bytes"] + 2 * PART_SIZE
    for kind in ("sync", "async", "dcp"):
        target = "<= 1.0" if kind != "dcp" else ""
        rows.append((f"peak RSS growth / (rank's bytes + 2 parts) ({kind})", peak[kind] / bound, [],
                     target, f"{peak[kind] / mib:.0f} MiB vs {peak['rank_bytes'] / mib:.0f} + "
                     f"{2 * PART_SIZE / mib:.0f} MiB"))  # fmt: skip
    size = w2["bytes_total"] / mib
    print(f"state size {size:.0f} MiB, W=2, {len(t['ours_save'])} rounds, {os.cpu_count()} cores")
    print(f"{'measure':<52} {'value':>7}  {'target':<8} per round; note")
    for name, value, per, target, note in rows:
        rounds = f"{statistics.median(per):.3f} ({min(per):.3f} .. {max(per):.3f}); " if per else ""
        print(f"{name:<52} {value:>7.3f}  {target:<8} {rounds}{note}")
    print(json.dumps({"w2": w2, "loads": loads}))
    (save, load, w3, _, _, blocked_row, sync_peak, async_peak, _) = rows
    others = (f"load / DCP {load[1]:.3f}, load W'=3 / W'=2 {w3[1]:.3f} (<= 1.1), async blocked / sync "
              f"{blocked_row[1]:.3f} (<= 0.02), peak RSS growth / (rank's bytes + 2 parts) sync "
              f"{sync_peak[1]:.3f}, async {async_peak[1]:.3f} (<= 1.0); {size:.0f} MiB")  # fmt: skip
    emit(save[0], save[1], target=save[3], spread=f"{_rounds(save[2])}; {others}")


def _rounds(per: list[float]) -> str:
    return f"{min(per):.3f} .. {max(per):.3f} over {len(per)} rounds" if len(per) > 1 else "1 round"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds (after a warm-up round)")
    parser.add_argument("--async-saves", type=int, default=4)
    parser.add_argument("--scratch", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["save", "loads"])
    parser.add_argument("--result", default="")
    args = parser.parse_args()
    if args.worker:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        res = {"save": worker_save, "loads": worker_loads}[args.worker](args)
        if dist.get_rank() == 0:
            Path(args.result).write_text(json.dumps(res))
        dist.destroy_process_group()
        return
    from tests.s3server import SeaweedServer

    with tempfile.TemporaryDirectory(prefix="elastrain-s3-bench-") as tmp:
        args.scratch = str(Path(tmp) / "scratch")
        started = time.monotonic()
        with SeaweedServer(Path(tmp) / "seaweed") as server:
            up = time.monotonic()
            os.environ.update(server.env())
            w2 = _launch(2, "save", args)
            saved = time.monotonic()
            loads = _launch(max(LOAD_WORLDS), "loads", args)
        print(f"weed mini up in {up - started:.1f} s, the W=2 launch {saved - up:.1f} s, "
              f"the W=3 launch {time.monotonic() - saved:.1f} s")  # fmt: skip
        _report(w2, loads)


if __name__ == "__main__":
    main()
