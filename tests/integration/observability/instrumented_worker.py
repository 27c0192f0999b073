"""The real worker with :class:`worker.metrics.WorkerMetrics` wired in from outside — the wiring
the trainer is to get (see H5's report), done here by wrapping three of its methods so that the
observability tests run a real training job until the lead wires it in ``worker/trainer.py``.

Run it like the worker: ``torchrun ... instrumented_worker.py --config SPEC``. After training,
each rank keeps serving its metrics until the file ``$ELASTRAIN_TEST_RELEASE`` exists (at most
two minutes), so that a test can query Prometheus while every series is still live.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from worker import main as worker_main
from worker.events import Events
from worker.metrics import WorkerMetrics, peak_memory_bytes
from worker.trainer import Trainer

_CURRENT: list[WorkerMetrics] = []
_start, _train_window, _run, _emit = Trainer.start, Trainer._train_window, Trainer.run, Events.emit


def start(self: Trainer) -> None:
    metrics = WorkerMetrics.from_env(job=self.spec.name, rank=self.info.rank, world_size=self.info.world_size)
    _CURRENT.append(metrics)
    self.metrics = metrics  # type: ignore[attr-defined]
    self.data_wait = 0.0  # type: ignore[attr-defined]
    batch = self.data.batch

    def timed_batch(indices: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return batch(indices)
        finally:
            self.data_wait += time.perf_counter() - t0  # type: ignore[attr-defined]

    self.data.batch = timed_batch  # type: ignore[method-assign]
    _start(self)
    wrapped = getattr(self, "wrapped", None) or getattr(self, "ddp", None)
    ddp = getattr(wrapped, "module", wrapped)  # worker.setup.Wrapped holds the DDP module
    if isinstance(ddp, DistributedDataParallel):  # FSDP has no comm hook: exposed comm stays 0
        ddp.register_comm_hook(None, metrics.comm.hook)


def train_window(self: Trainer, window: Any) -> tuple[bool, float]:
    metrics: WorkerMetrics = self.metrics  # type: ignore[attr-defined]
    self.data_wait = 0.0  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    skipped, loss = _train_window(self, window)
    seconds = time.perf_counter() - t0
    local = sum(m.bounds[self.info.rank][1] - m.bounds[self.info.rank][0] for m in window.micro_steps)
    tokens = local * int(self.data.meta.get("seq_len", 0))
    step = self.progress.step + (0 if skipped else 1)
    metrics.observe_step(seconds, local, tokens, self.data_wait, step=step)  # type: ignore[attr-defined]
    if skipped:
        metrics.skipped()
    if self.spec.precision == "fp16":
        metrics.set_scale(self.scaler.scale, min_scale=self.spec.loss_scale.min_scale)
    metrics.peak_memory(peak_memory_bytes(self.info.device))
    if self.checkpointer is not None:
        metrics.checkpoint(self.checkpointer.stats.as_metrics())
    return skipped, loss


def run(self: Trainer) -> dict[str, Any]:
    out = _run(self)
    metrics: WorkerMetrics = self.metrics  # type: ignore[attr-defined]
    if self.checkpointer is not None:
        metrics.checkpoint(self.checkpointer.stats.as_metrics())
    metrics.flush()
    release = os.environ.get("ELASTRAIN_TEST_RELEASE")
    deadline = time.monotonic() + 120
    while release and not Path(release).exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    metrics.close()
    return out


def emit(self: Events, event: str, **fields: Any) -> None:
    if _CURRENT:
        metrics = _CURRENT[-1]
        if event == "progress":
            if fields.get("loss") is not None:
                metrics.set_loss(fields["loss"])
            fields.update(metrics.progress_fields())
        elif event == "grad_stats":
            metrics.grad_stats(fields["zero_fraction"], fields["min_nonzero"])
    _emit(self, event, **fields)


Trainer.start = start  # type: ignore[method-assign]
Trainer._train_window = train_window  # type: ignore[method-assign]
Trainer.run = run  # type: ignore[method-assign]
Events.emit = emit  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(worker_main.main())
