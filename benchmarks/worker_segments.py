"""The worker's step against the bare DDP step in one launch, alternating every few steps.

:mod:`benchmarks.worker_throughput` compares whole runs, and on a shared machine a burst of load
from another process during one run swings a round's ratio by 10-50%. Here each rank builds the
worker's Trainer (as ``-m worker`` does: the spec, the exporter, the loader) and the bare loop's
own DDP model in the same process and group, and alternates: ``--segment`` worker steps (its own
``run()`` loop: data, step, metrics, events), then as many bare steps (benchmarks/bare_ddp.py's
body). A burst hits a few adjacent segments of both. Prints the median step of each and the
median over pairs of bare / worker time (the throughput ratio; target >= 0.98), with the load.

``--modes`` cycles the worker's segments through diagnostic variants, each against its own
adjacent bare segments: ``base``; ``noflag`` (no all-reduce of the non-finite flag and loss:
numerically unsafe, for attributing cost only); ``nomon`` (no underflow watch); ``nometrics``
(no exporter).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.worker_throughput import _torchrun
from benchmarks.worker_throughput import spec as bench_spec


def _child(spec_path: str, segment: int, modes: list[str]) -> None:
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import worker.train.step as step_module
    from worker.datapath.datasets import build_data, loss_sum
    from worker.jobspec.spec import load_spec
    from worker.metrics import WorkerMetrics
    from worker.report.events import Events
    from worker.start import dist
    from worker.start.build import build
    from worker.start.models import build_model
    from worker.train.trainer import Trainer

    spec = load_spec(spec_path)
    info = dist.detect(os.environ, backend="gloo", gpus=0)
    built = build(spec, info, resuming=False)
    dist.init_group(info, timeout_s=300)
    metrics = WorkerMetrics.from_env(job=spec.name, rank=info.rank, world_size=info.world_size)
    trainer = Trainer(built, info, events=Events(enabled=False, job=spec.name, rank=info.rank),
                      checkpointer=None, generation=0, metrics=metrics)  # fmt: skip
    trainer.start()
    real_dist, real_monitor = step_module.dist, trainer.monitor

    class OneRank:
        def __getattr__(self, name: str) -> Any:
            return getattr(tdist, name)

        def get_world_size(self) -> int:
            return 1

    def set_mode(mode: str) -> None:
        step_module.dist = OneRank() if mode == "noflag" else real_dist  # type: ignore[assignment]
        trainer.monitor = None if mode == "nomon" else real_monitor  # type: ignore[assignment]
        trainer.metrics = None if mode == "nometrics" else metrics

    torch.manual_seed(spec.seed)
    data = build_data(spec.data, spec.seed)
    model = DDP(build_model(spec.model, data.meta), bucket_cap_mb=spec.ddp.bucket_cap_mb,
                gradient_as_bucket_view=True)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=spec.optimizer.lr)
    b, accum, world, rank = spec.micro_batch_size, spec.accum_steps_or_default, info.world_size, info.rank
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(spec.seed))
    at: dict[str, Any] = {"cursor": 0, "steps": 0, "mark": 0.0, "segments": 0, "mode": modes[0]}
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}

    def bare_steps(n: int) -> None:
        for _ in range(n):
            for micro in range(accum):
                cursor = 0 if at["cursor"] + world * b > len(data) else at["cursor"]
                at["cursor"] = cursor + world * b
                x, y = data.batch(order[cursor + rank * b : cursor + (rank + 1) * b].numpy())
                with contextlib.nullcontext() if micro == accum - 1 else model.no_sync():
                    (loss_sum(data.task, model(x), y) / (b * accum)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optimizer.grad_clip_norm or 1e9)
            opt.step()
            opt.zero_grad(set_to_none=True)

    observe = Trainer._observe_step

    def alternate(self: Trainer, seconds: float, skipped: bool) -> None:
        if self.metrics is not None:
            observe(self, seconds, skipped)
        at["steps"] += 1
        if at["steps"] % segment:
            return
        worker_s = time.perf_counter() - at["mark"]
        started = time.perf_counter()
        bare_steps(segment)
        bare_s = time.perf_counter() - started
        if at["segments"] >= len(modes):  # the first of each mode warms up
            times[at["mode"]].append((worker_s, bare_s))
        at["segments"] += 1
        at["mode"] = modes[at["segments"] % len(modes)]
        set_mode(at["mode"])
        at["mark"] = time.perf_counter()

    Trainer._observe_step = alternate  # type: ignore[method-assign]
    at["mark"] = time.perf_counter()
    trainer.run()
    if info.rank == 0:
        out = {}
        for mode, pairs in times.items():
            out[mode] = {
                "pairs": len(pairs),
                "worker_ms": 1e3 * statistics.median(w for w, _ in pairs) / segment,
                "bare_ms": 1e3 * statistics.median(b for _, b in pairs) / segment,
                "ratio": statistics.median(b / w for w, b in pairs),
                "ratio_of_sums": sum(b for _, b in pairs) / sum(w for w, _ in pairs),
            }
        print(json.dumps(out), flush=True)
    tdist.barrier()
    dist.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3000, help="worker steps (as many bare steps)")
    parser.add_argument("--segment", type=int, default=5)
    parser.add_argument("--modes", default="base")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(bench_spec("fp32", args.steps)))
        child = ["-m", "benchmarks.worker_segments", "--child", str(path), str(args.segment), args.modes]
        out = _torchrun(args.nproc, *child, timeout=None)
    result = json.loads(out.strip().splitlines()[-1])
    steps = f"fp32, W={args.nproc}, {args.steps} steps each"
    print(f"worker / bare steps alternating every {args.segment} ({steps})")
    for mode, r in result.items():
        print(
            f"  {mode:<10} worker {r['worker_ms']:.2f} ms/step, bare {r['bare_ms']:.2f} ms/step; throughput "
            f"ratio {r['ratio']:.3f} (median of {r['pairs']} pairs; of the sums {r['ratio_of_sums']:.3f})"
        )
    print(f"  load average (1 min) before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], int(sys.argv[3]), sys.argv[4].split(","))
        sys.exit(0)
    sys.exit(main())
