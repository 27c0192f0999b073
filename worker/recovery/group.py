"""The process group of one generation: tear the broken one down, host or reach the new one's
store, and ``init_process_group`` with the generation's rank and world size.

Tear-down rules (each measured here): call :func:`teardown` outside any ``except`` block, after
the caller dropped every reference to DDP (and so to the group's sockets); no barrier (the group
is broken), no ``gc.collect()`` (190-410 ms here) and no ``abort()`` on gloo (it does not
interrupt a blocked op, and costs 340-550 ms). Tearing down at once is what makes the *other*
survivors' pending collectives fail in milliseconds instead of at their timeout.

The torch bookkeeping goes at once (the next ``init_process_group`` can follow), but the old
group's object is released on a background thread: destroying a gloo group (closing its pairs,
joining its threads) takes ~30 ms here at W=3 and holds no lock the next generation needs, so it
leaves the critical path of a re-formation (the join's longest step, a recovery's kill -> first
step) while its sockets still close within those milliseconds. ``atexit`` waits for a release
in flight (a bounded wait), so a process never exits in the middle of one.

The generation's store is a ``TCPStore`` that its leader hosts on an ephemeral port, used for the
gloo mesh's rendezvous (keys under ``g<generation>/``) and for sub-groups; it lives until the next
generation forms.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker.recovery.control import split_address
from worker.start.dist import DistInfo


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
        """``base`` (from :func:`worker.start.dist.detect`) with this generation's rank and world size."""
        return dataclasses.replace(
            base, rank=self.rank, world_size=self.world_size, backend=self.backend, device=self.device
        )


RELEASE_WAIT_AT_EXIT_S = 5.0
RELEASE_POLL_MAX_S = 0.01
_releases: list[tuple[threading.Thread, list[object]]] = []


def teardown() -> None:
    """Destroy the default group now, broken or not, and release its object in the background
    (see the module docstring). Idempotent."""
    if not dist.is_initialized():
        return
    held = dist.group.WORLD  # the last reference once the caller dropped DDP
    dist.destroy_process_group()
    release(held)


def release(group: object) -> None:
    """Drop ``group`` (destroyed in torch's books) on a thread, once the caller's references
    are gone (the caller's frame returns in microseconds; after 1 s the thread lets go anyway
    and the last holder destroys it, as before). A group a thread already waits for is left to
    that thread (a DDP wrapper carried over to the next group lets go of a group that its
    teardown handed to a thread): two waiting threads would each see the other's reference."""
    alive = [(t, h) for t, h in _releases if t.is_alive()]
    if any(h and h[0] is group for _, h in alive):
        _releases[:] = alive
        return
    held = [group]
    thread = threading.Thread(target=_drop_when_alone, args=(held,), name="elastrain-group-release",
                              daemon=True)  # fmt: skip
    _releases[:] = [*alive, (thread, held)]
    del group
    thread.start()


def _drop_when_alone(held: list[object]) -> None:
    """Poll every 1 ms at first (a broken group's sockets should close within milliseconds: the
    other survivors' collectives fail on that), then back off to 10 ms (a carried-over wrapper
    lets go only after the state transfer, and a 1 kHz poller competes for the GIL meanwhile)."""
    deadline, pause = time.monotonic() + 1.0, 0.001
    while sys.getrefcount(held[0]) > 2 and time.monotonic() < deadline:  # the list's and the argument's
        time.sleep(pause)
        pause = min(2 * pause, RELEASE_POLL_MAX_S)
    held.clear()


@atexit.register
def _await_releases() -> None:
    for thread, _ in list(_releases):
        thread.join(RELEASE_WAIT_AT_EXIT_S)


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
    """Destroy a sub-group; its object goes on a thread, as the default group's does."""
    if group is not None:
        dist.destroy_process_group(group)
        release(group)
