"""worker/start/startgc.py: the collector off while a worker starts, frozen and on again after."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from worker.start import startgc


@pytest.fixture
def collector() -> Iterator[None]:
    """This process's collector as it was, after the test (and nothing left frozen)."""
    was = gc.isenabled()
    yield
    gc.unfreeze()
    startgc._held, startgc._frozen = False, 0
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


def test_the_state_does_not_count_the_frozen_objects_again(
    collector: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer reads the state at every generation's first step, on the training thread:
    counting the permanent generation walks it (30 ms for a worker's 300,000 objects, in the
    window after every join), so the count is the one taken when they were frozen."""
    gc.enable()
    startgc.hold()
    startgc.release()
    frozen = gc.get_freeze_count()

    def walks() -> int:
        raise AssertionError("gc.get_freeze_count walks every frozen object")

    monkeypatch.setattr(gc, "get_freeze_count", walks)
    assert startgc.state() == {"enabled": True, "frozen_at_start": frozen}


def test_nothing_frozen_says_zero(collector: None) -> None:
    gc.enable()
    startgc.release()  # never held: nothing frozen
    assert startgc.state() == {"enabled": True, "frozen_at_start": 0}
