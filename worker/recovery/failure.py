"""What went wrong, as a value that keeps no traceback (pure, torch-free).

A caller catches the exception of a window, turns it into a :class:`Failure` with
:func:`classify` inside the ``except`` block, and handles it *after* leaving the block: the
traceback's frames hold the DDP wrapper, which holds the process group and its sockets, and a
survivor blocked on this member then waits a whole collective timeout (measured:
20 s instead of 35-41 ms). Nothing here stores the exception.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from worker.errors import ReplicaMismatchError
from worker.recovery.vote import Fenced, NotCommitted

# Transport and c10d errors that mean "a member of the group is gone or stalled", as gloo, c10d
# and NCCL word them (seen here: 'Connection reset by peer', 'Connection closed by peer',
# 'Timed out waiting 2000ms for recv operation to complete', ...).
_GROUP_ERRORS = (
    "gloo/transport",
    "connection reset",
    "connection closed",
    "connection refused",
    "timed out waiting",
    "pair closure",
    "broken pipe",
    "socket timeout",
    "nccl",
    "process group",
    "processgroup",
    "default process group has not been initialized",
)
_GROUP_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")


@dataclass(frozen=True, slots=True)
class Failure:
    """``kind``: ``crash`` (a member is gone or stalled: the group is broken), ``fenced`` (the
    vote saw another stamp, or the leader found its generation not written), ``planned`` (the
    vote asked for a re-formation at this boundary), ``fatal`` (anything else: this process
    exits and its agent respawns it), ``mismatch`` (the data-parallel replicas' state disagrees:
    nobody's is trusted, the group restores the newest checkpoint). ``in_window``: the failure
    happened inside a window (its gradients are voided)."""

    kind: str
    at: float
    message: str
    in_window: bool = True

    @property
    def recoverable(self) -> bool:
        return self.kind != "fatal"

    @property
    def is_planned(self) -> bool:
        return self.kind == "planned"

    @staticmethod
    def planned(*, at: float | None = None) -> Failure:
        return Failure("planned", time.time() if at is None else at, "planned re-formation", in_window=False)


def is_incident(failure: Failure, lost: tuple[str, ...]) -> bool:
    """Whether a re-formation after ``failure`` that lost the members ``lost`` is an incident --
    recorded by its leader and reported to the service: any failure, and a planned
    re-formation (a join) only when it lost a member too. Pure."""
    return not failure.is_planned or bool(lost)


def classify(exc: BaseException, *, in_window: bool = True, at: float | None = None) -> Failure:
    """A failure value for ``exc`` (call it inside the ``except`` block; keep only the value)."""
    when = time.time() if at is None else at
    message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    if isinstance(exc, (Fenced, NotCommitted)):
        return Failure("fenced", when, message, in_window)
    if isinstance(exc, ReplicaMismatchError):
        return Failure("mismatch", when, message, in_window)
    names = {t.__name__ for t in type(exc).__mro__}
    text = str(exc).lower()
    if names & set(_GROUP_TYPES) or (
        isinstance(exc, (RuntimeError, ConnectionError, TimeoutError))
        and any(marker in text for marker in _GROUP_ERRORS)
    ):
        return Failure("crash", when, message, in_window)
    return Failure("fatal", when, message, in_window)
