"""One optimizer step over a window of micro-steps.

Accumulation: ``no_sync`` on all but the last micro-step, and each micro-step's loss is its sum
of per-sample losses times ``W / N``, where N is the window's true global sample count. DDP
averages over the W ranks, so the gradient is the mean over exactly the window's samples — with
equal batches this is the usual division by A, done once; with unequal batches every sample
weighs the same, never a mean of means.

The host waits for the device once per step: the loss stays on the device while the micro-steps
run, and :func:`optimizer_step` reads one small vector at the step's end — whether any rank's
gradients are non-finite, the window's global loss sum (both all-reduced together) and, on the
steps that measure them, the gradient statistics. Every read of a device value in the step goes
through :func:`to_host`, so that a test can count them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from worker.datapath.feed import MicroBatch
from worker.failpoints import failpoint
from worker.start.parts import Wrapped, local
from worker.train import preemption
from worker.train.amp import DynamicLossScaler, autocast
from worker.train.monitor import GradMonitor, GradStats
from worker.train.objective import Objective, call_model


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the step's one read from the device says."""

    skipped: bool
    loss_sum: float
    """The window's loss summed over every sample of every rank (divide by the window's samples)."""
    stats: GradStats | None = None
    """The gradient statistics, on a step that measured them and was not skipped."""
    votes: tuple[float, ...] = ()
    """The ``votes`` given to :func:`optimizer_step`, summed over the ranks."""
    stop: int = 0
    """How many ranks asked the group to stop after this window (:mod:`worker.train.preemption`)."""


class Commit(Protocol):
    """Peer mode's commit point (:mod:`worker.peer.loop`, :mod:`worker.recovery.vote`)."""

    def ballot(self) -> Sequence[float]:
        """This rank's part of the commit vote, summed by the step's own all-reduce: element 0
        added to the non-finite flag, the rest appended (:mod:`worker.recovery.vote`)."""
        ...

    def decide(self, found: bool, summed: Sequence[float]) -> bool:
        """The group's non-finite flag from the summed ballots (element 0: the summed flag);
        raises when the group broke or disagrees (then nothing is applied)."""
        ...


def to_host(values: torch.Tensor) -> list[float]:
    """The one place the step waits for the device: a small vector, read once per step."""
    return [float(v) for v in values.tolist()]


def forward_backward(
    wrapped: Wrapped,
    batches: Iterable[MicroBatch],
    *,
    micro_steps: int,
    weight: float,
    objective: Objective,
    precision: str,
    scale: float,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """Run a window's ``micro_steps`` micro-batches; gradients end up synchronised and scaled by
    ``scale``. ``weight`` is W / N (N: the window's global sample count). ``objective`` picks from
    the forward's output and gives the micro-batch's per-sample loss sum. Returns this rank's loss
    sum (a float64 tensor on ``device``, not read here) and its sample count."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    last = micro_steps - 1
    for j, micro in enumerate(batches):
        sync = contextlib.nullcontext() if j == last else wrapped.no_sync()
        with sync:
            with autocast(precision, device):
                out = call_model(wrapped.module, micro.inputs)
            loss = objective.loss_sum(out, micro.targets)
            (loss * (weight * scale)).backward()
        total += loss.detach().double()
        count += len(micro.indices)
    return total, count


def optimizer_step(
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scaler: DynamicLossScaler,
    *,
    lr: float,
    clip: float | None,
    loss_sum: torch.Tensor | None = None,
    sharded: bool = False,
    monitor: GradMonitor | None = None,
    measure: bool = False,
    votes: Sequence[float] = (),
    commit: Commit | None = None,
    stop: bool = False,
) -> StepResult:
    """Unscale, agree across ranks on non-finite gradients, clip, step; ``params`` are the
    optimizer's, in the monitor's order.

    One pass over the gradients computes every gradient's norm; it serves the non-finite check,
    the underflow watch (``monitor``: every step; the statistics too when ``measure``) and clipping
    alike. The non-finite flag and this rank's ``loss_sum`` are all-reduced together, and while
    they travel the clipping and the watch run on the device (a skipped step throws that work
    away); then the step's one read (:func:`to_host`) decides. ``votes`` (numbers the ranks must
    agree on, such as a save wanted by a local clock) travel with the flag and come back summed.
    ``commit`` (peer mode, :mod:`worker.peer.loop`) is the window's commit vote: its ballot travels in
    the same all-reduce (its first number added to the flag: a request that counts, while the
    flag is 0, and is lost when it is NaN), and once every rank's contribution arrived and before
    any state changes it decides the group's flag, or raises when the group broke (then nothing
    was applied). ``stop``: this rank asks the group to stop after this window; the request
    rides on element 0 too (:mod:`worker.train.preemption`) and ``StepResult.stop`` says how many
    ranks asked.
    With ``sharded`` (FSDP) each rank holds a slice of every gradient, so the clipping norm is
    summed over ranks.
    """
    with_grad = [p for p in params if p.grad is not None]
    grads = [local(p.grad) for p in with_grad if p.grad is not None]
    if failpoint("after_grad_sync") == "nonfinite":
        grads[0].view(-1)[0] = float("inf")
    scaler.unscale(grads)
    if loss_sum is None:
        loss_sum = torch.zeros((), dtype=torch.float64)
    device = grads[0].device if grads else loss_sum.device
    norms = torch.stack(torch._foreach_norm(grads)) if grads else torch.zeros(0, device=device)
    # 0 when every norm is finite, NaN when one is not (inf * 0 and NaN * 0 are NaN); summed over
    # the ranks it stays NaN if any rank's was. Two ops, where isfinite/any take six.
    flag = (norms * 0).sum().double()
    ballot = commit.ballot() if commit is not None else ()
    request = (ballot[0] if ballot else 0.0) + preemption.ballot(stop)
    if request:  # a request (adding 0 would change nothing)
        flag = flag + request
    shared = torch.stack([flag, loss_sum.detach().double().to(device)])
    extra = [*votes, *ballot[1:]]
    if extra:
        shared = torch.cat([shared, torch.tensor(extra, dtype=torch.float64, device=device)])
    work = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        work = dist.all_reduce(shared, op=dist.ReduceOp.SUM, async_op=True)
    local_values: list[torch.Tensor] = []
    zero_run = None
    if monitor is not None:
        present = (
            None if len(with_grad) == len(params) else [i for i, p in enumerate(params) if p.grad is not None]
        )
        zero_run = monitor.advance(norms, present)
        if measure:
            local_values = [zero_run.double(), monitor.pending(grads, device=device)]
    if clip is not None and grads:
        _clip(grads, norms, clip, sharded=sharded)
    if work is not None:
        work.wait()
    values = to_host(torch.cat([shared, *local_values]) if local_values else shared)
    stopping, values_0 = preemption.split(values[0])
    global_loss = values[1]
    found = not math.isfinite(values_0)
    summed, ballots, values = (
        tuple(values[2 : 2 + len(votes)]),
        values[2 + len(votes) : 2 + len(extra)],
        values[2 + len(extra) :],
    )
    if commit is not None:  # the commit point: no collective from here to the end of the apply
        found = commit.decide(found, [values_0, *ballots])
    scaler.update(found)
    if found:
        optimizer.zero_grad(set_to_none=True)
        return StepResult(skipped=True, loss_sum=global_loss, votes=summed, stop=stopping)
    stats = None
    if monitor is not None and zero_run is not None:
        monitor.commit(zero_run)
        if measure:
            stats = monitor.stats(values, numel=sum(g.numel() for g in grads))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(skipped=False, loss_sum=global_loss, stats=stats, votes=summed, stop=stopping)


def _clip(grads: list[torch.Tensor], norms: torch.Tensor, max_norm: float, *, sharded: bool) -> None:
    """Scale all gradients so that their global L2 norm is at most ``max_norm`` (as
    ``clip_grad_norm_`` does), reusing the per-gradient norms; on the device, without a read (a
    factor of exactly 1 leaves every gradient's bits as they are)."""
    squared = norms.double().square().sum()
    if sharded and dist.is_initialized():
        dist.all_reduce(squared, op=dist.ReduceOp.SUM)
    coef = (max_norm / (squared.sqrt() + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype))


def global_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum small scalars over all ranks (a collective: every rank must call it)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return to_host(tensor)
