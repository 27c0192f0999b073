"""Run under torchrun: a few DDP steps (two micro-steps each, the first under ``no_sync``, grads
set to None after the step, as the trainer does) with and without worker.metrics.CommTimer as
the comm hook, from the same seeds. Rank 0 prints one JSON line: whether the parameters were
bit-identical, and the communication seconds the timer measured."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from worker.metrics import CommTimer


def train(timer: CommTimer | None, bucket_cap_mb: float) -> tuple[torch.Tensor, list[tuple[float, float]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(37, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 7),
    )
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
    if timer is not None:
        ddp.register_comm_hook(None, timer.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(100 + dist.get_rank())
    taken = []
    for _ in range(4):
        with ddp.no_sync():
            ddp(torch.randn(16, 37)).pow(2).sum().backward()
        ddp(torch.randn(16, 37)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if timer is not None:
            taken.append(timer.take())
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), taken


def main() -> int:
    dist.init_process_group("gloo")
    out = {}
    for cap in (25.0, 0.005):  # one bucket; several buckets
        plain, _ = train(None, cap)
        hooked, taken = train(CommTimer(), cap)
        out[str(cap)] = {"identical": bool(torch.equal(plain, hooked)), "taken": taken}
    if dist.get_rank() == 0:
        print(json.dumps({"world_size": dist.get_world_size(), "runs": out}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
