"""Peer mode's beacons: the last step each member completed, known to the one that leads the
next recovery, so that its report names the step each lost rank completed (docs/recovery.md,
"Hangs, named").

The trainer's :class:`worker.start.hangs.Beacon` publishes once a second (a thread; the training
thread only sets integers) into :class:`ControlStore`, which sends it on the control channel: a
member to its leader (``at``), the leader to its members. So the leader knows every member's last
step, and every member knows the leader's, for when the leader is the one lost. A stopped process
stops its beacon too: what the others hold is the last step it completed before it stopped (or
at most a second before). No collective and no etcd write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from worker.start.hangs import Report


class Teller(Protocol):
    def tell_completed(self, step: int) -> None: ...


class ControlStore:
    """The store a :class:`~worker.start.hangs.Beacon` writes to, over the control channel. Only
    ``set`` is used: in peer mode the recovery's leader reads what the channel delivered."""

    def __init__(self, teller: Teller) -> None:
        self.teller = teller

    def set(self, key: str, value: str) -> None:
        self.teller.tell_completed(Report.parse(value.encode()).completed)

    def check(self, keys: list[str]) -> bool:
        return False

    def get(self, key: str) -> bytes:
        raise KeyError(key)


def last_completed(members: Sequence[str], lost: Sequence[str], steps: Mapping[str, int]) -> dict[str, int]:
    """The lost members' last completed steps by their rank in ``members`` (the broken
    generation's order), as strings (JSON keys); a member whose beacon never arrived is left out.
    Pure."""
    return {str(members.index(m)): steps[m] for m in lost if m in members and m in steps}
