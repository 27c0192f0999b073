"""How often the workers call the service: each rank's heartbeat and each job's progress.

The service sets both from how many ranks and jobs it hears, and tells every worker in each
answer (``Ack``): what a thousand ranks at a fixed period would cost grows with the work while one
instance's capacity does not. Small services keep the fastest periods; past
:data:`HEARTBEATS_PER_S` heartbeats a second the period lengthens, up to a third of the heartbeat
timeout, so a live node still beats three times before it could be judged silent (a Kubernetes
node renews its lease four times within its grace; Hadoop's JobTracker likewise spread its
trackers' heartbeats to a fixed number a second as the cluster grew). Progress is never asked for
less often than heartbeats. Pure.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from service.jobs.model import JobRecord, JobState

HEARTBEAT_S = 5.0
"""The fastest heartbeat period (each rank)."""
PROGRESS_S = 2.0
"""The fastest progress period (each job's rank 0)."""
HEARTBEATS_PER_S = 400.0
"""Heartbeats a second the service aims at (the period lengthens past it)."""
PROGRESS_PER_S = 100.0
"""Progress reports a second the service aims at."""


@dataclass(frozen=True, slots=True)
class Cadence:
    heartbeat_s: float = HEARTBEAT_S
    progress_s: float = PROGRESS_S


def cadence_for(ranks: int, jobs: int, *, heartbeat_timeout_s: float) -> Cadence:
    """The periods for ``ranks`` heartbeating ranks in ``jobs`` reporting jobs."""
    slowest = max(HEARTBEAT_S, heartbeat_timeout_s / 3)
    heartbeat = min(max(HEARTBEAT_S, ranks / HEARTBEATS_PER_S), slowest)
    progress = min(max(PROGRESS_S, jobs / PROGRESS_PER_S), heartbeat)
    return Cadence(heartbeat_s=heartbeat, progress_s=progress)


def cadence_of(records: Iterable[JobRecord], *, heartbeat_timeout_s: float) -> Cadence:
    """The periods for the ranks of these jobs' active nodes (queued and ended jobs send none)."""
    live = [r for r in records if not r.state.terminal and r.state != JobState.QUEUED]
    ranks = sum(len(r.active_nodes) * r.nproc_per_node for r in live)
    return cadence_for(ranks, len(live), heartbeat_timeout_s=heartbeat_timeout_s)
