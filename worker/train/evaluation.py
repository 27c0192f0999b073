"""The held-out loss: every held-out sample counted once, over all ranks."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from worker.datapath.datasets import Dataset
from worker.datapath.sampler import split_evenly
from worker.train.amp import autocast
from worker.train.objective import Objective, call_model, to_device
from worker.train.step import global_sum


def evaluate(
    model: nn.Module, data: Dataset, *, objective: Objective, precision: str, device: torch.device,
    micro_batch: int, rank: int, world_size: int,
) -> tuple[float, int]:  # fmt: skip
    """The mean loss over ``data`` and its sample count (a collective: every rank calls it). The
    ranks take disjoint slices (no padding duplicates), a micro-batch at a time (a held-out file
    may be large); the model is left in train mode."""
    lo, hi = split_evenly(0, len(data), world_size)[rank]
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    with torch.no_grad():
        for start in range(lo, hi, micro_batch):
            x, y = data.batch(np.arange(start, min(start + micro_batch, hi)))
            with autocast(precision, device):
                out = call_model(model, to_device(x, device))
            total += objective.loss_sum(out, to_device(y, device)).double()
    summed, count = global_sum([float(total), float(hi - lo)], device)
    model.train()
    return summed / count, int(count)
