"""Which ranks a timed-out collective waited for, and the last step each completed.

A collective that never completes says only that it timed out. So each rank keeps a *beacon*
in the group's store (the store the process group was created on, under its round's prefix): a
thread publishes ``(sequence, position, completed)`` once a second, where ``completed`` is the
last step the rank completed and ``position`` where it is in the window after it -- ``2 s - 1``
once it entered step ``s``'s forward and backward (DDP's gradient all-reduce runs there), ``2 s``
once it reached the step's own all-reduce (:func:`worker.train.step.optimizer_step`). The training
thread only sets two integers; the store sees one small write per rank per second.

When this rank's collective fails, it reads every beacon twice, :data:`RECHECK_S` apart. A rank
did not arrive when its position is behind this rank's, or its beacon is missing, or its
sequence did not move between the reads (a stopped or dead process: SIGSTOP stops the thread
too). A rank stuck before its backward (in its data loader, say) and one waiting inside DDP's
all-reduce hold the same position, so the first is named only by a peer that got further.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

EVERY_S = 1.0
RECHECK_S = 2.5 * EVERY_S
KEY = "elastrain/beacon/"


class Store(Protocol):
    def set(self, key: str, value: str) -> None: ...

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Report:
    """One beacon as read: ``sequence`` grows while the process runs."""

    sequence: int
    position: int
    completed: int

    @staticmethod
    def parse(raw: bytes) -> Report:
        sequence, position, completed = (int(v) for v in raw.decode().split(","))
        return Report(sequence, position, completed)


@dataclass(frozen=True, slots=True)
class Absent:
    """A rank the collective waited for."""

    rank: int
    completed: int | None
    """The last step it completed (None: it never published a beacon)."""
    why: str


def absent(
    first: Mapping[int, Report | None],
    second: Mapping[int, Report | None],
    *,
    me: int,
    position: int,
    world_size: int,
) -> list[Absent]:
    """The ranks that did not arrive where this rank (``me``, at ``position``) waited, from two
    reads of the beacons. Pure."""
    out = []
    for rank in range(world_size):
        if rank == me:
            continue
        before, now = first.get(rank), second.get(rank)
        if now is None:
            out.append(Absent(rank, None, "no beacon"))
        elif now.position < position:
            out.append(Absent(rank, now.completed, "behind"))
        elif before is not None and before.sequence == now.sequence:
            out.append(Absent(rank, now.completed, "not running"))
    return out


def describe(missing: Sequence[Absent]) -> str:
    """``rank 1 (last completed step 41, not running)``, comma-separated. Pure."""
    parts = []
    for a in missing:
        step = "no step reported" if a.completed is None else f"last completed step {a.completed}"
        parts.append(f"rank {a.rank} ({step}, {a.why})")
    return ", ".join(parts)


class Beacon:
    """This rank's beacon, published from a daemon thread (see the module docstring)."""

    def __init__(self, store: Store, *, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.position = 0
        self.completed = 0
        self._sequence = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elastrain-beacon", daemon=True)
        self._thread.start()

    def entered(self, step: int) -> None:
        """This rank began step ``step``'s forward and backward."""
        self.position = 2 * step - 1

    def reduces(self, step: int) -> None:
        """This rank reached step ``step``'s own all-reduce."""
        self.position = 2 * step

    def done(self, step: int) -> None:
        self.completed = step

    def _run(self) -> None:
        while not self._stop.wait(EVERY_S if self._sequence else 0):
            self._publish()

    def _publish(self) -> None:
        self._sequence += 1
        with contextlib.suppress(Exception):  # the store gone with the group: nothing to tell
            self.store.set(f"{KEY}{self.rank}", f"{self._sequence},{self.position},{self.completed}")

    def _read(self) -> dict[int, Report | None]:
        out: dict[int, Report | None] = {}
        for rank in range(self.world_size):
            key = f"{KEY}{rank}"
            try:
                out[rank] = Report.parse(self.store.get(key)) if self.store.check([key]) else None
            except Exception:  # unreadable: as good as missing
                out[rank] = None
        return out

    def missing(self) -> list[Absent]:
        """Who this rank's failed collective waited for (blocks :data:`RECHECK_S`)."""
        first = self._read()
        time.sleep(RECHECK_S)
        return absent(first, self._read(), me=self.rank, position=self.position, world_size=self.world_size)

    def close(self) -> None:
        self._stop.set()
