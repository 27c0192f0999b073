"""A tiny model + AdamW and a single-process Checkpointer on a temp directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.checkpoint.checkpointer import Checkpointer, EventHook
from worker.jobspec.spec import CheckpointSpec


def model_and_optim(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU(), nn.Linear(12, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(5, 6)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()


def checkpointer(
    root: Path, *, job: str = "unit", rank: int = 0, world_size: int = 1, open_on_thread: bool = False,
    generation: int = 0, after: Checkpointer | None = None, on_event: EventHook | None = None, **cfg: Any,
) -> Checkpointer:  # fmt: skip
    spec = CheckpointSpec(dir=str(root), **cfg)
    return Checkpointer(
        spec, job=job, spec_hash="h", data_version="1", rank=rank, world_size=world_size,
        generation=generation, parallelism="ddp", seed=7, run_record={"who": "unit"}, block_size=128,
        open_on_thread=open_on_thread, after=after, on_event=on_event,
    )  # fmt: skip


def state_equal(a: nn.Module, b: nn.Module, oa: torch.optim.Optimizer, ob: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
        return False
    xa, xb = oa.state_dict(), ob.state_dict()
    for k in xa["state"]:
        for key, value in xa["state"][k].items():
            if not torch.equal(value, xb["state"][k][key]):
                return False
    return xa["param_groups"] == xb["param_groups"]


def save(
    ck: Checkpointer, model: nn.Module, optim: torch.optim.Optimizer, step: int, **progress: Any
) -> None:
    progress = {"step": step, "samples_seen": 5 * step, **progress}
    ck.save(step=step, model=model, optimizer=optim, progress=progress, metrics={"loss": 1.0 / step})
