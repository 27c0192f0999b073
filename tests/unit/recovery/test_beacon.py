"""Peer mode's beacons (worker.recovery.beacon): a member's last completed step reaches its
leader, the leader's reaches its members, and a recovery names each lost rank's step by its rank
in the broken generation."""

from __future__ import annotations

from typing import cast

from tests.unit.recovery.test_hub import FakeConn, hub_with
from worker.recovery.beacon import ControlStore, last_completed
from worker.recovery.control import Conn


class Told:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def tell_completed(self, step: int) -> None:
        self.steps.append(step)


def test_the_beacon_tells_the_step_it_completed() -> None:
    told = Told()
    store = ControlStore(told)
    store.set("elastrain/beacon/1", "7,83,41")  # (sequence, position, completed): hangs.Beacon's
    assert told.steps == [41] and not store.check(["elastrain/beacon/1"])


def test_the_leader_keeps_each_members_last_step() -> None:
    b, c = FakeConn("b"), FakeConn("c")
    hub = hub_with(b, c)
    for step in (40, 41):
        hub.on_message(cast(Conn, b), {"t": "at", "step": step})
    hub.on_message(cast(Conn, c), {"t": "at", "step": True})  # not a step: ignored
    hub.on_message(cast(Conn, c), {"t": "at", "step": -1})
    assert hub.steps == {"b": 41} and b.sent == [] and c.sent == []


def test_the_lost_ranks_steps_by_their_rank_in_the_broken_generation() -> None:
    steps = {"a": 42, "b": 41, "x": 9}
    assert last_completed(("a", "b", "c"), ("b", "c"), steps) == {"1": 41}  # c never said a step
    assert last_completed(("a", "b"), ("a",), steps) == {"0": 42}
    assert last_completed(("a", "b"), (), steps) == {}
