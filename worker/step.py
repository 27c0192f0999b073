"""One optimizer step over a window of micro-steps.

Accumulation: ``no_sync`` on all but the last micro-step, and each micro-step's loss is its sum
of per-sample losses times ``W / N``, where N is the window's true global sample count. DDP
averages over the W ranks, so the gradient is the mean over exactly the window's samples — with
equal batches this is the usual division by A, done once; with unequal batches every sample
weighs the same, never a mean of means.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from worker.amp import DynamicLossScaler, any_rank_non_finite, autocast
from worker.data import Dataset
from worker.failpoints import failpoint
from worker.objective import Objective, call_model, to_device
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
    objective: Objective,
    rank: int,
    world_size: int,
    seed: int,
    precision: str,
    scale: float,
    device: torch.device,
) -> tuple[float, int, float]:
    """Run the window's micro-steps; gradients end up synchronised and scaled by ``scale``.
    Returns this rank's loss sum, its sample count and the seconds spent waiting for data.
    ``objective`` picks from the forward's output and gives the micro-batch's per-sample loss sum."""
    weight = world_size / window.samples
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    data_wait = 0.0
    last = len(window.micro_steps) - 1
    size = len(data)
    for j, micro in enumerate(window.micro_steps):
        started = time.perf_counter()
        idx = indices(seed, window.epoch, size, micro.bounds[rank])
        x, y = data.batch(idx)
        x, y = to_device(x, device), to_device(y, device)
        data_wait += time.perf_counter() - started
        sync = contextlib.nullcontext() if j == last else wrapped.no_sync()
        with sync:
            with autocast(precision, device):
                out = call_model(wrapped.module, x)
            loss = objective.loss_sum(out, y)
            (loss * (weight * scale)).backward()
        total += loss.detach().double().cpu()
        count += len(idx)
    return float(total), count, data_wait


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: DynamicLossScaler,
    *,
    lr: float,
    clip: float | None,
    sharded: bool = False,
    on_norms: Callable[[list[torch.Tensor | None]], None] | None = None,
) -> bool:
    """Unscale, agree across ranks on non-finite gradients, clip, step. Returns True if skipped.

    One pass over the gradients computes every gradient's norm; it serves the non-finite check,
    the underflow watch and clipping alike. With ``sharded`` (FSDP) each rank holds a slice of
    every gradient, so the clipping norm is summed over ranks.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [local(p.grad) for p in params if p.grad is not None]
    if failpoint("after_grad_sync") == "nonfinite":
        grads[0].view(-1)[0] = float("inf")
    scaler.unscale(grads)
    norms = list(torch._foreach_norm(grads)) if grads else []
    device = grads[0].device if grads else torch.device("cpu")
    found = any_rank_non_finite(norms, device=device)
    scaler.update(found)
    if found:
        optimizer.zero_grad(set_to_none=True)
        return True
    if on_norms is not None:
        it = iter(norms)
        on_norms([None if p.grad is None else next(it) for p in params])
    if clip is not None and grads:
        _clip(grads, norms, clip, sharded=sharded)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return False


def _clip(grads: list[torch.Tensor], norms: list[torch.Tensor], max_norm: float, *, sharded: bool) -> None:
    """Scale all gradients so that their global L2 norm is at most ``max_norm`` (as
    ``clip_grad_norm_`` does), reusing the per-gradient norms."""
    squared = torch.stack(norms).double().square().sum()
    if sharded and dist.is_initialized():
        dist.all_reduce(squared, op=dist.ReduceOp.SUM)
    coef = max_norm / (float(squared.sqrt()) + 1e-6)
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)


def global_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum small scalars over all ranks (a collective: every rank must call it)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]
