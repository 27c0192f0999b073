"""A destroyed group's object is dropped on a background thread once nobody else holds it, and a
group that one thread already waits for gets no second waiter (a DDP wrapper carried over to the
next group lets go of the group its teardown handed to a thread: two waiters would each see the
other's reference and hold it for their whole second)."""

from __future__ import annotations

import threading
import weakref

from worker.recovery import group


class Held:
    """Stands in for a process group: something with a reference count and a weakref."""


def _freed_on(obj: Held) -> tuple[threading.Event, list[str]]:
    done, where = threading.Event(), []

    def freed(_: object) -> None:
        where.append(threading.current_thread().name)
        done.set()

    obj.ref = weakref.ref(obj, freed)  # type: ignore[attr-defined]
    return done, where


def _waiting_for(obj: Held) -> int:
    return sum(1 for t, held in group._releases if t.is_alive() and held and held[0] is obj)


def test_the_last_reference_goes_on_the_release_thread() -> None:
    obj = Held()
    done, where = _freed_on(obj)
    mine = obj
    group.release(obj)
    del obj
    assert _waiting_for(mine) == 1  # the caller still holds it: the thread waits
    del mine
    assert done.wait(5.0)
    assert where == ["elastrain-group-release"]


def test_a_group_released_twice_has_one_waiter() -> None:
    obj = Held()
    done, where = _freed_on(obj)
    group.release(obj)  # the teardown's
    group.release(obj)  # the carry-over's, while the first still waits
    assert _waiting_for(obj) == 1
    del obj
    assert done.wait(5.0)
    assert where == ["elastrain-group-release"]
