"""One optimizer step over a window of micro-steps.

Accumulation: ``no_sync`` on all but the last micro-step, and each micro-step's loss is its sum
of per-sample losses times ``W / N``, where N is the window's true global sample count. DDP
averages over the W ranks, so the gradient is the mean over exactly the window's samples — with
equal batches this is the usual division by A, done once; with unequal batches every sample
weighs the same, never a mean of means.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from worker.amp import DynamicLossScaler, autocast
from worker.data import Dataset, loss_sum
from worker.failpoints import failpoint
from worker.sampler import Window, indices
from worker.setup import Wrapped, local


@dataclass(frozen=True, slots=True)
class StepResult:
    skipped: bool
    local_loss_sum: float
    local_samples: int


def forward_backward(
    wrapped: Wrapped,
    data: Dataset,
    window: Window,
    *,
    rank: int,
    world_size: int,
    seed: int,
    precision: str,
    scale: float,
    device: torch.device,
) -> tuple[float, int]:
    """Run the window's micro-steps; gradients end up synchronised and scaled by ``scale``."""
    weight = world_size / window.samples
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    last = len(window.micro_steps) - 1
    size = len(data)
    for j, micro in enumerate(window.micro_steps):
        idx = indices(seed, window.epoch, size, micro.bounds[rank])
        x, y = data.batch(idx)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync = contextlib.nullcontext() if j == last else wrapped.no_sync()
        with sync:
            with autocast(precision, device):
                out = wrapped.module(x)
            loss = loss_sum(data.task, out, y)
            (loss * (weight * scale)).backward()
        total += loss.detach().double().cpu()
        count += len(idx)
    return float(total), count


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: DynamicLossScaler,
    *,
    lr: float,
    clip: float | None,
    on_grads: Callable[[list[torch.Tensor | None]], None] | None = None,
) -> bool:
    """Unscale, agree across ranks on non-finite gradients, clip, step. Returns True if skipped."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [local(p.grad) for p in params if p.grad is not None]
    if failpoint("after_grad_sync") == "nonfinite":
        grads[0].view(-1)[0] = float("inf")
    found = scaler.unscale_and_check(grads, group=None)
    scaler.update(found)
    if found:
        optimizer.zero_grad(set_to_none=True)
        return True
    if on_grads is not None:
        on_grads([None if p.grad is None else local(p.grad) for p in params])
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(params, clip, foreach=True)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return False


def global_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum small scalars over all ranks (a collective: every rank must call it)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]
