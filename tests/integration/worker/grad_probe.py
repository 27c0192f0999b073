"""Computes one window's synchronised gradients with the worker's own code and saves them.

Run as ``python grad_probe.py OUT CONFIGS_JSON`` (one process) or under torchrun. Each config is
{"b": micro batch, "a": accumulation steps, "cursor": epoch position}; rank 0 saves, for each
config, every parameter's gradient, and every rank checks its gradients equal rank 0's.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from worker.datapath.datasets import build_data
from worker.datapath.feed import Feed
from worker.datapath.sampler import SamplerState, plan_window
from worker.jobspec.spec import DataSpec, ModelSpec
from worker.start import dist as wdist
from worker.start.models import build_model
from worker.start.parts import seed_all, wrap
from worker.train.objective import Objective
from worker.train.step import forward_backward


def main() -> None:
    out, configs = sys.argv[1], json.loads(sys.argv[2])
    info = wdist.detect(os.environ, backend="gloo", gpus=0)
    wdist.init_group(info)
    data = build_data(DataSpec(name="synthetic", samples=100), seed=5)
    seed_all(11)
    model = build_model(ModelSpec(name="mlp", kwargs={"hidden": 16}), data.meta)
    wrapped = wrap(model, info, parallelism="ddp", bucket_cap_mb=0.001)  # tiny buckets: several all-reduces
    saved = {}
    for i, cfg in enumerate(configs):
        window = plan_window(
            SamplerState(0, cfg["cursor"]),
            dataset_size=100,
            world_size=info.world_size,
            micro_batch=cfg["b"],
            accum_steps=cfg["a"],
        )
        feed = Feed(
            data, seed=5, rank=info.rank, world_size=info.world_size, micro_batch=cfg["b"],
            accum_steps=cfg["a"], device=torch.device("cpu"),
        )  # fmt: skip
        forward_backward(
            wrapped,
            feed.batches(SamplerState(0, cfg["cursor"]), window),
            micro_steps=len(window.micro_steps),
            weight=info.world_size / window.samples,
            objective=Objective(task=data.task),
            precision="fp32",
            scale=1.0,
            device=torch.device("cpu"),
        )
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for name, grad in grads.items():
            reference = grad.clone()
            dist.broadcast(reference, src=0)
            assert torch.equal(reference, grad), f"rank {info.rank} gradient {name} differs from rank 0"
        saved[i] = {"grads": grads, "micro_steps": len(window.micro_steps), "samples": window.samples}
        model.zero_grad(set_to_none=True)
    if info.rank == 0:
        torch.save(saved, out)
    wdist.shutdown()


if __name__ == "__main__":
    main()
