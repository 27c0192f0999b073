"""What a run's failures cost, pure: the phases of one recovery from its time stamps, a run's peer
incidents, and goodput. One place for this arithmetic: the service's metrics (:mod:`service.metrics`) and
``elastrain report`` (:mod:`service.report`) both use it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from service.jobs.model import Recovery

PHASES = ("detect", "reform", "restore", "first_step")
"""The phases of a recovery; a peer recovery's third is ``transfer`` (state from a peer's memory)."""


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    start: float
    seconds: float


def phase_names(kind: str = "restart") -> tuple[str, ...]:
    """The four phase names of a recovery of ``kind`` (``peer`` | ``storage`` | ``restart``)."""
    return ("detect", "reform", "transfer" if kind == "peer" else "restore", "first_step")


def recovery_phases(
    *,
    failed_at: float,
    detected_at: float | None = None,
    group_formed_at: float | None = None,
    state_loaded_at: float | None = None,
    first_step_at: float | None = None,
    kind: str = "restart",
) -> list[Phase]:
    """The phases of one recovery, in order, from the time stamps known: ``detect`` (failure ->
    noticed), ``reform`` (-> the new group formed), ``transfer`` for a peer recovery or
    ``restore`` (-> the state in place), ``first_step``. ``failed_at`` is the failure (the last
    sign of life of what was lost). A phase whose end is unknown merges into the next one
    (``detect+reform``); phases after the last known stamp are left out."""
    ends = (detected_at, group_formed_at, state_loaded_at, first_step_at)
    out: list[Phase] = []
    start, merged = failed_at, []
    for name, end in zip(phase_names(kind), ends, strict=True):
        merged.append(name)
        if end is None:
            continue
        out.append(Phase("+".join(merged), start, max(0.0, end - start)))
        start, merged = max(start, end), []
    return out


def phases_of(recovery: Recovery) -> list[Phase]:
    """:func:`recovery_phases` of a job record's recovery."""
    return recovery_phases(
        failed_at=recovery.failed_at,
        detected_at=recovery.detected_at,
        group_formed_at=recovery.group_formed_at,
        state_loaded_at=recovery.state_loaded_at,
        first_step_at=recovery.first_step_at,
        kind=recovery.kind,
    )


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


def peer_incidents(
    events: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]], t0: float
) -> list[dict[str, Any]]:
    """Peer-mode incidents in a run's events (``elastrain report``): one per ``recovery_incident``
    event, with its kind, what was lost, the phases (the first step is the first of ``steps``, the
    step events, after the group was ready again) and what moved; times relative to ``t0``."""
    out = []
    for e in (e for e in events if e["event"] == "recovery_incident"):
        given = e.get("phases")
        stamps: dict[str, Any] = given if isinstance(given, dict) else {}
        failed = _time(e.get("failed_at")) or _time(stamps.get("detected")) or e["time"]
        ready = _time(stamps.get("ready")) or e["time"]
        first = next((s["time"] for s in steps if s["time"] >= ready), None)
        phases = recovery_phases(
            failed_at=failed,
            detected_at=_time(e.get("detected_at")) or _time(stamps.get("detected")),
            group_formed_at=_time(stamps.get("formed")),
            state_loaded_at=_time(stamps.get("transferred")),
            first_step_at=first,
            kind=str(e.get("kind", "peer")),
        )
        out.append(
            {
                "incident": e.get("incident"),
                "kind": e.get("kind"),
                "at_seconds": round(failed - t0, 3),
                "lost": e.get("lost_launch_ids") or [],
                "recovery_seconds": None if first is None else round(first - failed, 3),
                "phases": [{"name": p.name, "seconds": round(p.seconds, 3)} for p in phases],
                "bytes_from_peers": e.get("bytes_from_peers") or 0,
                "voided_windows": e.get("voided_windows") or 0,
                "world_before": e.get("world_before"),
                "world_after": e.get("world_after"),
            }
        )
    return out


def _time(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
