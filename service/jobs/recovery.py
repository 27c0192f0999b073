"""What a run's failures cost, pure: the phases of one recovery from its time stamps, and
goodput. One place for this arithmetic: the service's metrics (:mod:`service.metrics`) and
``elastrain report`` (:mod:`service.report`) both use it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PHASES = ("detect", "reform", "restore", "first_step")


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    start: float
    seconds: float


def recovery_phases(
    *,
    failed_at: float,
    detected_at: float | None = None,
    group_formed_at: float | None = None,
    state_loaded_at: float | None = None,
    first_step_at: float | None = None,
    from_detection: bool = False,
) -> list[Phase]:
    """The phases of one recovery, in order, from the time stamps known. ``failed_at`` is the
    failure (or the last sign of life before it); with ``from_detection`` it is the moment the
    failure was noticed and there is no detect phase. A phase whose end is unknown merges into
    the next one (``detect+reform``); phases after the last known stamp are left out."""
    ends = (detected_at, group_formed_at, state_loaded_at, first_step_at)
    out: list[Phase] = []
    start, merged = failed_at, []
    skip = 1 if from_detection else 0
    for name, end in zip(PHASES[skip:], ends[skip:], strict=True):
        merged.append(name)
        if end is None:
            continue
        out.append(Phase("+".join(merged), start, max(0.0, end - start)))
        start, merged = max(start, end), []
    return out


def goodput(*, wall_seconds: float, productive_seconds: float) -> float | None:
    """Productive step time over wall time, in [0, 1]; None before any wall time passed."""
    if wall_seconds <= 0:
        return None
    return min(1.0, max(0.0, productive_seconds / wall_seconds))


def estimated_goodput(
    *, wall_seconds: float, recovery_seconds: Sequence[float], steps_lost: int, step_seconds: float | None
) -> float | None:
    """The service's view (it sees no step times): wall time less recoveries and redone steps."""
    lost = sum(recovery_seconds) + steps_lost * (step_seconds or 0.0)
    return goodput(wall_seconds=wall_seconds, productive_seconds=wall_seconds - lost)
