"""The baseline: a plain torchrun + DDP loop (~40 lines) on the worker's model and data.

Run under torchrun: ``python -m torch.distributed.run --nproc-per-node 2 benchmarks/bare_ddp.py SPEC``.
Same model, data, batch, precision, bucket size and DDP options as the worker
(``gradient_as_bucket_view``, gradients set to None after each step); no checkpoints, no
monitoring, no non-finite agreement: the floor the worker's own cost is measured against.
Rank 0 prints ``{"samples_per_second": ...}`` measured after the first ``log_every_steps`` steps.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from worker.datapath.datasets import build_data, loss_sum
from worker.jobspec.spec import load_spec
from worker.start.models import build_model
from worker.train.amp import DTYPES


def main() -> None:
    spec = load_spec(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.seed)
    data = build_data(spec.data, spec.seed)
    model = DDP(
        build_model(spec.model, data.meta), bucket_cap_mb=spec.ddp.bucket_cap_mb, gradient_as_bucket_view=True
    )
    opt = torch.optim.AdamW(model.parameters(), lr=spec.optimizer.lr)
    scaler = torch.amp.GradScaler("cpu", enabled=spec.precision == "fp16")
    b, accum = spec.micro_batch_size, spec.accum_steps_or_default
    g = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(data), generator=g)
    cursor, start = 0, 0.0
    for step in range(spec.max_steps):
        if step == spec.log_every_steps:
            start = time.perf_counter()
        for micro in range(accum):
            if cursor + world * b > len(data):
                cursor = 0
            idx = order[cursor + rank * b : cursor + (rank + 1) * b].numpy()
            cursor += world * b
            x, y = data.batch(idx)
            sync = contextlib.nullcontext() if micro == accum - 1 else model.no_sync()
            with sync:
                ctx = torch.autocast("cpu", dtype=DTYPES[spec.precision], enabled=spec.precision != "fp32")
                with ctx:
                    out = model(x)
                loss = loss_sum(data.task, out, y) / (b * accum)
                scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.optimizer.grad_clip_norm or 1e9)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - start
    samples = (spec.max_steps - spec.log_every_steps) * world * b * accum
    if rank == 0:
        print(json.dumps({"samples_per_second": samples / elapsed, "pid": os.getpid()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
