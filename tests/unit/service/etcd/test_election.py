"""Leader election on the in-memory store: a lost lease is said once in the log, whichever caller
finds out (the keep-alive thread or the next campaign)."""

from __future__ import annotations

import logging

import pytest

from service.etcd.election import LeaderElection
from service.etcd.memory import MemoryStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("finder", ["keep_alive", "campaign"])
def test_a_lost_lease_is_logged_by_whichever_caller_finds_it(
    caplog: pytest.LogCaptureFixture, finder: str
) -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    a = LeaderElection(store, "a", ttl_s=9, clock=clock)
    b = LeaderElection(store, "b", ttl_s=9, clock=clock)
    assert a.campaign() is not None and b.campaign() is None
    clock.now += 20  # a was stopped past its lease
    assert b.campaign() is not None
    with caplog.at_level(logging.WARNING, logger="elastrain.election"):
        found = a.keep_alive() if finder == "keep_alive" else a.campaign()
    assert not found and a.fence is None
    assert [r.getMessage() for r in caplog.records] == ["leader lease lost: a no longer leads"]
