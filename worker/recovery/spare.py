"""A warm spare: pay the process's start-up costs ahead, then wait, registered and connected to the
leader, until a lost rank's place is given to it (issue14-design.md §3.9).

The costs a replacement pays that a spare pays ahead: ``import torch``, building data, model and
optimizer (the caller's), and DDP's first wrap in a process (0.9-3.0 s here: it imports
``torch._dynamo``, E1) — :func:`warm_up` wraps the model on a private world of one and runs the
caller's step once, which also creates the optimizer's state. The state it leaves is never used:
a promoted spare receives every byte from a peer.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from worker.recovery.group import teardown
from worker.recovery.recover import GroupMember, Outcome, RecoverableState


def warm_up(
    model: nn.Module, step: Callable[[DistributedDataParallel], None], *, bucket_cap_mb: float
) -> None:
    """One DDP wrap and one ``step(ddp)`` on a private world-of-one gloo group, torn down after."""
    teardown()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
        step(ddp)
        del ddp
    finally:
        teardown()


def standby(member: GroupMember, state: RecoverableState) -> Outcome:
    """Wait, connected to the leader, to be promoted; then receive the state like any newcomer.
    Blocks without using the CPU (a thread reads the leader's connection)."""
    member.emit("spare_standby", {"member_id": member.member_id, "control": member.me.control})
    return member.join(state)
