"""DDP on the new generation's group, and the one-iteration settle.

In torch 2.13 a new DDP reducer's first iteration puts every parameter in one bucket and
rebuilds ``bucket_cap_mb`` buckets in gradient-ready order from its second iteration on
(torch 2.13's reducer). For W >= 3 gloo's ring adds an element's contributions in an order that
depends on the element's offset in its bucket, so a first real step on a fresh wrapper gives
other bits than the uninterrupted run, which has used the rebuilt layout since its second step.
:func:`settle` runs that first iteration on a zero loss: one forward, a backward of
``0 * loss`` (the buckets' all-reduces of zeros record the ready order), gradients dropped and
persistent buffers (norm statistics) restored — so the first real step after a re-formation runs
on the rebuilt layout. Random draws of the settle do not matter: every window re-derives its
generators (:mod:`worker.recovery.rng`), after the settle.

:func:`bucket_layout` reads the layout DDP reports (``rebuilt_per_bucket_param_indices``; its
logging lags an iteration, so read it from the second real step on); :func:`layout_digest` is
what the members compare before carrying their wrappers over.

A planned re-formation (a scale-up at a window boundary) need not pay the wrap and the settle at
all: the survivors' reducers are already settled, so each keeps its DDP and only points it at the
new group (:func:`carry_over`, keeping its buckets), and a newcomer settles its own
DDP beforehand in its private world of one (:func:`prepare`, off the join's critical path). That
is safe only when every member's buckets hold the same parameters at the same offsets (a bucket
is all-reduced as one flat tensor): the members compare :func:`layout_digest` in the hand-over's
last all-gather, and any difference, or a member without a settled DDP, makes every member wrap
afresh and settle as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import xxhash
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from worker.recovery.group import release
from worker.start.dist import DistInfo
from worker.start.parts import wrap_ddp

Forward = Callable[[nn.Module], torch.Tensor]


def settle(ddp: DistributedDataParallel, forward: Forward) -> None:
    """One zero-loss iteration on ``ddp`` (a collective: every member calls it). ``forward``
    runs the wrapped module on a small fixed input and returns a scalar."""
    module = ddp.module
    saved = [b.detach().clone() for b in module.buffers()]
    loss = forward(ddp)
    (loss * 0.0).backward()
    for p in module.parameters():
        p.grad = None
    with torch.no_grad():
        for buffer, value in zip(module.buffers(), saved, strict=True):
            buffer.copy_(value)


def rewrap(
    model: nn.Module, info: DistInfo, *, bucket_cap_mb: float, forward: Forward | None, agreed: bool = True
) -> DistributedDataParallel:
    """DDP around ``model`` on the current default group (the trainer's own
    :func:`worker.start.parts.wrap_ddp`), settled when ``forward`` is given. ``agreed``: the members
    hold a state they agreed on by digest (:mod:`worker.recovery.handover`), so DDP's broadcast
    of rank 0's parameters at construction is skipped (its buffers go before every forward
    anyway); a state each member loaded itself (``agreed=False``) keeps that broadcast."""
    ddp = wrap_ddp(model, info, bucket_cap_mb=bucket_cap_mb, init_sync=not agreed)
    if forward is not None:
        settle(ddp, forward)
    return ddp


def bucket_layout(ddp: DistributedDataParallel) -> str | None:
    """The rebuilt buckets' parameter indices, e.g. ``"5 4 3 2, 1 0"``; None until DDP reports
    them (from the iteration after the rebuild)."""
    data = ddp._get_ddp_logging_data()
    layout = data.get("rebuilt_per_bucket_param_indices")
    return str(layout) if layout else None


NO_LAYOUT = bytes(16)
PREPARE_ITERATIONS = 4  # DDP rebuilds at the 2nd iteration and reports it from the 3rd


def layout_digest(ddp: DistributedDataParallel | None) -> bytes:
    """A digest of ``ddp``'s settled bucket layout; :data:`NO_LAYOUT` when there is no DDP or it
    has not reported a rebuilt layout yet (never equal to a real one)."""
    layout = bucket_layout(ddp) if ddp is not None else None
    return xxhash.xxh3_128(layout.encode()).digest() if layout else NO_LAYOUT


def prepare(ddp: DistributedDataParallel, forward: Forward) -> None:
    """Settle a newcomer's DDP in its private world of one until it reports its rebuilt layout
    (zero-loss iterations, see :func:`settle`; at most :data:`PREPARE_ITERATIONS`)."""
    for _ in range(PREPARE_ITERATIONS):
        if bucket_layout(ddp):
            return
        settle(ddp, forward)


def carry_over(ddp: DistributedDataParallel) -> None:
    """Point a settled ``ddp`` at the current default group (every member of the new group
    calls this, or none: see the module docstring). Its buckets stay as they are: the members
    agreed that their layouts are the same, so nothing is rebuilt. (torch's
    ``_update_process_group`` also resets the reducer, which then records the ready order in the
    first step after the join and rebuilds the same buckets at the next, with a broadcast of
    their indices: that step's excess over the later steps' median was 11 ms with the reset and
    5 ms without, in 8 interleaved runs of the carry-over test's setup here (17 MB in 1 MB
    buckets, 3 processes, noisy). What the reset would clear besides is clear already
    at a window boundary: a finished backward leaves no hooks expected and the division factor
    unset, so the first all-reduce divides by the new group's size.) The old group is released
    on a thread, as a teardown's is: ``old`` is held here until the reducer let go of it too, so
    its destruction never falls on this thread."""
    old = ddp.process_group
    group = dist.distributed_c10d._get_default_group()
    ddp.process_group = group
    ddp.reducer._update_process_group(group)
    release(old)
    del old
