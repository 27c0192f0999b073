"""What the worker's step costs besides the model: counted, not timed against a noisy clock.

Runs ``python -m worker`` in this process (one rank) on the throughput benchmark's spec and
counts, per optimizer step: the aten operations the training thread dispatches inside a step
(``TorchDispatchMode``: each is a kernel launch on a GPU, most an allocation), the reads of a
device value among them (``aten._local_scalar_dense``: ``.item()``, ``float()``, ``bool()``; a
``.tolist()`` or ``.cpu()`` of a CPU tensor dispatches nothing, so on CPU these undercount: see
``tests/unit/worker/test_host_syncs.py`` for the exact count), the voluntary context switches of
all the process's threads (``/proc/self/task/*/status``: wake-ups), and the time spent in the events and
metrics calls. ``--bare`` counts the same for the baseline loop's step (benchmarks/bare_ddp.py's
body, one rank). Point ``PYTHONPATH`` at another checkout to count its worker the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.worker_throughput import spec as bench_spec


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def switches() -> int:
    """Voluntary context switches of all the process's threads: each is a thread going to sleep
    (a lock, a queue, a wait for a peer) and so, later, a wake-up. (Involuntary ones measure the
    machine's load, not the worker.)"""
    total = 0
    for status in Path("/proc/self/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[-1])
    return total


def timed(owner: Any, name: str, bucket: list[float], training: dict[str, int]) -> None:
    """Add the time of ``owner.name`` calls made while training (not at start or at the end)."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if training["steps"] and not training["finished"]:
                bucket[0] += time.perf_counter() - started

    setattr(owner, name, wrapper)


def count_worker(path: Path, steps: int) -> dict[str, float]:
    import worker.train.trainer as trainer_module
    from worker.main import main
    from worker.metrics import WorkerMetrics
    from worker.report.events import Events

    mode, counted = Ops(), {"steps": 0, "switches": 0, "finished": 0}
    original, finish = trainer_module.Trainer._train_window, trainer_module.Trainer._finish
    reporting = [0.0]
    for owner, names in ((Events, ("emit", "say")), (WorkerMetrics, ("observe_step", "progress_fields"))):
        for name in names:
            timed(owner, name, reporting, counted)

    def finished(self: Any) -> Any:
        counted["finished"] = 1
        return finish(self)

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = switches()
        with mode:
            out = original(self, *args, **kwargs)
        counted["steps"] += 1
        counted["switches"] += switches() - before
        return out

    trainer_module.Trainer._train_window = step  # type: ignore[method-assign]
    trainer_module.Trainer._finish = finished  # type: ignore[method-assign]
    with contextlib.redirect_stdout(sys.stderr):
        main(["--config", str(path)])
    n = counted["steps"]
    return {
        "aten_ops_per_step": sum(mode.ops.values()) / n,
        "device_reads_per_step (item/float/bool)": mode.ops["_local_scalar_dense"] / n,
        "wakeups_per_step": counted["switches"] / n,
        "events_and_metrics_us_per_step": 1e6 * reporting[0] / n,
        "threads": len(list(Path("/proc/self/task").iterdir())),
    }


def count_bare(steps: int) -> dict[str, float]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from worker.datapath.datasets import build_data, loss_sum
    from worker.jobspec.spec import parse_spec
    from worker.start.models import build_model

    spec = parse_spec(bench_spec("fp32", steps))
    torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    data = build_data(spec.data, spec.seed)
    model = DDP(build_model(spec.model, data.meta), gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.optimizer.lr)
    order = torch.randperm(len(data))
    mode, n_switch = Ops(), 0
    b = spec.micro_batch_size
    for s in range(steps):
        before = switches()
        with mode:
            for micro in range(2):
                x, y = data.batch(order[(2 * s + micro) * b : (2 * s + micro + 1) * b].numpy())
                with contextlib.nullcontext() if micro == 1 else model.no_sync():
                    (loss_sum(data.task, model(x), y) / (2 * b)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        n_switch += switches() - before
    torch.distributed.destroy_process_group()
    return {
        "aten_ops_per_step": sum(mode.ops.values()) / steps,
        "device_reads_per_step (item/float/bool)": mode.ops["_local_scalar_dense"] / steps,
        "wakeups_per_step": n_switch / steps,
    }


@contextlib.contextmanager
def one_rank_env() -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(
        {"OMP_NUM_THREADS": "1", "ELASTRAIN_METRICS_PORT": os.environ.get("ELASTRAIN_METRICS_PORT", "auto")}
    )
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--bare", action="store_true")
    parser.add_argument("--prefetch", type=int, default=None, help="the worker's data.prefetch")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with one_rank_env(), tempfile.TemporaryDirectory() as tmp:
        if args.bare:
            result = count_bare(args.steps)
        else:
            path = Path(tmp) / "spec.json"
            spec = bench_spec("fp32", args.steps)
            if args.prefetch is not None:
                spec["data"]["prefetch"] = args.prefetch  # type: ignore[index]
            path.write_text(json.dumps(spec))
            result = count_worker(path, args.steps)
    print(json.dumps({"who": "bare" if args.bare else "worker", **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
