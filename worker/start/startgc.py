"""The garbage collector while a worker process starts.

Starting a worker imports torch, TorchDynamo (DDP's constructor imports it) and DCP's state-dict
helpers: about 300,000 objects that live as long as the process (modules, functions, classes).
The collector's automatic passes over them find next to nothing and cost CPU: five full
collections of 15-180 ms each in a peer-mode worker here. A one-process five-step run took
3.1-3.4 s of CPU with what follows against 3.5-4.9 s without (4 alternating runs).

``python -m worker`` calls :func:`hold` before its first import: the automatic collector is off.
:func:`release`, once the run is built and restored (or, in peer mode, once the process stands
ready to join), collects once (start-up's own garbage in reference cycles, about 9,000 objects
and 0.2 s here, and whatever cycles the team's model and data code dropped while building), moves
every object alive then into the permanent generation (``gc.freeze``, which later collections do
not walk) and turns the collector on again: training allocates and collects as usual, and a full
collection later walks only what was allocated since. A process that did not call :func:`hold`
(the worker's code run in another program, the tests) is left as it is.
"""

from __future__ import annotations

import gc

_held = False
_frozen = 0  # objects release() froze: counted once (the count walks them: 30 ms for 300,000 here)


def hold() -> None:
    """Turn the automatic collector off for the process's start (if it is on)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def release() -> None:
    """Freeze what start-up left alive and turn the collector on again; idempotent, and a no-op
    unless :func:`hold` turned it off."""
    global _held, _frozen
    if _held:
        _held = False
        gc.collect()  # nothing start-up dropped is frozen with what it keeps
        gc.freeze()
        _frozen = gc.get_freeze_count()
        gc.enable()


def state() -> dict[str, object]:
    """For the run record: whether the collector runs, and how many objects start-up froze (0
    when :func:`release` froze nothing). Cheap: the trainer asks at every generation's first
    step, on the training thread, where counting the frozen objects again (``gc.get_freeze_count``
    walks them) cost 30 ms of the window after a join."""
    return {"enabled": gc.isenabled(), "frozen_at_start": _frozen}
