"""Heartbeats and progress written behind: held, then written together, fenced like any write."""

from __future__ import annotations

import pytest

from service.etcd.kv import Fence
from service.etcd.memory import MemoryStore
from service.jobs.errors import NotLeaderError
from service.jobs.writebehind import MAX_OPS, WriteBehind
from service.jobs.writes import LeaderWrites

LATER = 3600.0  # the batch's own writer waits this long: the test flushes


class Leader:
    def __init__(self) -> None:
        self.store = MemoryStore()
        lease = self.store.lease_grant(60)
        self.fence: Fence | None = Fence("me", lease)
        self.store.put(self.fence.key, b"me", lease_id=lease)
        self.dropped: list[int] = []
        self.behind = WriteBehind(
            LeaderWrites(self.store, fence_source=lambda: self.fence),
            delay_s=LATER,
            on_dropped=self.dropped.append,
        )

    def revision(self) -> int:
        self.store.put("probe", b"")
        found = self.store.get("probe")
        assert found is not None
        return found.mod_revision


def test_values_wait_for_the_batch_and_go_in_one_transaction_per_max_ops_keys() -> None:
    leader = Leader()
    for n in range(MAX_OPS + 1):
        leader.behind.put(f"beat/{n}", b"old")
    leader.behind.put("beat/0", b"new")  # the newest value of a key only
    assert leader.store.get("beat/0") is None  # held
    before = leader.revision()
    assert leader.behind.flush() == MAX_OPS + 1
    assert leader.revision() == before + 3  # two transactions, then the probe
    found = leader.store.get("beat/0")
    assert found is not None and found.value == b"new"
    assert leader.behind.flush() == 0


def test_a_standby_refuses_at_once_and_a_deposed_leaders_batch_is_dropped_and_counted() -> None:
    leader = Leader()
    leader.behind.put("beat/a", b"1")
    leader.behind.drop("beat/")  # the job ended: nothing of it is written
    leader.behind.put("progress/b", b"2")
    held = leader.fence
    leader.fence = None
    with pytest.raises(NotLeaderError):
        leader.behind.put("beat/c", b"3")
    assert held is not None
    leader.store.lease_revoke(held.lease_id)  # another instance leads now
    leader.fence = held  # this one still believes it leads: etcd refuses the batch
    assert leader.behind.flush() == 0
    assert leader.dropped == [1]
    assert leader.store.get("progress/b") is None and leader.store.get("beat/a") is None
