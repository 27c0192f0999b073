"""The process group of one generation: tear the broken one down, host or reach the new one's
store, and ``init_process_group`` with the generation's rank and world size.

Tear-down rules (issue14-design.md E3): call :func:`teardown` outside any ``except`` block, after
the caller dropped every reference to DDP (and so to the group's sockets); no barrier (the group
is broken), no ``gc.collect()`` (190-410 ms here) and no ``abort()`` on gloo (it does not
interrupt a blocked op, E2, and costs 340-550 ms). Tearing down at once is what makes the *other*
survivors' pending collectives fail in milliseconds instead of at their timeout.

The generation's store is a ``TCPStore`` that its leader hosts on an ephemeral port, used for the
gloo mesh's rendezvous (keys under ``g<generation>/``) and for sub-groups; it lives until the next
generation forms.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker.dist import DistInfo
from worker.recovery.control import split_address


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """Where this process stands in a generation."""

    generation: int
    rank: int
    world_size: int
    members: tuple[str, ...]
    leader: str
    backend: str = "gloo"
    device: str = "cpu"

    def dist_info(self, base: DistInfo) -> DistInfo:
        """``base`` (from :func:`worker.dist.detect`) with this generation's rank and world size."""
        return dataclasses.replace(
            base, rank=self.rank, world_size=self.world_size, backend=self.backend, device=self.device
        )


def teardown() -> None:
    """Destroy the default group now, broken or not (see the module docstring). Idempotent."""
    if dist.is_initialized():
        dist.destroy_process_group()


class StoreHost:
    """The generation's ``TCPStore``, hosted by its leader on an ephemeral port."""

    def __init__(self, advertise: str, *, timeout_s: float, bind: str = "0.0.0.0") -> None:
        self.store: dist.TCPStore | None = dist.TCPStore(
            bind, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        self.address = f"{advertise}:{self.store.port}"

    def close(self) -> None:
        """Stop serving (members that formed no longer need it). Idempotent."""
        self.store = None


class Group:
    """A formed generation: its info and the store client its sub-groups use."""

    def __init__(self, info: GroupInfo, store: dist.Store, host: StoreHost | None) -> None:
        self.info, self.store, self.host = info, store, host

    def close(self) -> None:
        teardown()
        if self.host is not None:
            self.host.close()


def form(info: GroupInfo, *, store_address: str, timeout_s: float, host: StoreHost | None = None) -> Group:
    """``init_process_group`` for ``info`` on the store at ``store_address`` (``host``'s own
    store when this process hosts it). Blocks until every member of the generation joined or
    ``timeout_s`` passed."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if host is not None and host.store is not None and host.address == store_address:
        store: dist.Store = host.store
    else:
        addr, port = split_address(store_address)
        store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False, timeout=timeout)
    if info.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(info.device))
    teardown()
    dist.init_process_group(
        info.backend,
        store=dist.PrefixStore(f"g{info.generation}/", store),
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
    )
    return Group(info, store, host)


def subgroup(ranks: list[int]) -> dist.ProcessGroup | None:
    """A group of ``ranks`` (every member of the default group must call this with the same
    list); None when it would be the whole default group."""
    if len(ranks) == dist.get_world_size():
        return None
    return dist.new_group(ranks=sorted(ranks))


def destroy_subgroup(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.destroy_process_group(group)
