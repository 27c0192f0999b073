"""worker/startgc.py: the collector off while a worker starts, frozen and on again after."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from worker import startgc


@pytest.fixture
def collector() -> Iterator[None]:
    """This process's collector as it was, after the test (and nothing left frozen)."""
    was = gc.isenabled()
    yield
    gc.unfreeze()
    startgc._held = False
    (gc.enable if was else gc.disable)()


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_held_then_released_the_collector_runs_and_start_up_is_frozen(collector: None) -> None:
    gc.enable()
    startgc.hold()
    assert not gc.isenabled()
    dropped = weakref.ref(Cycle())  # garbage in a cycle, dropped while the collector is off
    assert dropped() is not None
    startgc.release()
    assert dropped() is None  # collected before the freeze, not kept with start-up's objects
    assert gc.isenabled() and gc.get_freeze_count() > 0
    assert startgc.state() == {"enabled": True, "frozen_at_start": gc.get_freeze_count()}
    frozen = gc.get_freeze_count()
    startgc.release()  # idempotent: nothing frozen twice
    assert gc.get_freeze_count() == frozen


def test_a_process_that_did_not_hold_is_left_as_it_is(collector: None) -> None:
    gc.disable()  # a program that runs without the collector on purpose
    startgc.release()
    assert not gc.isenabled() and gc.get_freeze_count() == 0
    gc.enable()
    startgc.release()
    assert gc.isenabled() and gc.get_freeze_count() == 0
