"""One incident = one recovery: what the service sees and what the workers report, folded into the
job's recoveries by the same rules whatever order they arrive in. Pure.

Three kinds of observation open or join an incident (a :class:`~service.jobs.model.Recovery`):

* **a node lost** (the reconciler: its app ended or went silent), with its last sign of life
  (:class:`Loss`);
* **the worker group re-formed** without the service's doing (restart mode: torchrun restarted
  the group), with the group's last sign of life (the newest progress before it);
* **a worker's recovery report** (peer mode: ``recovery`` ``started`` / ``done``,
  :class:`Report`), with measured times.

The rules (the peer contract's, ``/work/notes/peer-contract.md``):

* A report joins the recovery with its incident id; else an unreported one (opened by the
  service) that lost one of the launch ids it lists, or an open one that lost nothing yet; it is
  *claimed*: its kind and times become the report's. Else it opens a recovery of its own.
* A lost node whose launch id an incident lost is an event on that incident. Otherwise it joins
  an open incident (a member of the old group failing too, or a replacement launched for it:
  that one costs a restart), or one closed less than ``window_s`` ago (two heartbeat timeouts)
  that no worker reported and whose repaired group formed after the node's last sign of life
  (the re-formation it caused came first). Otherwise it opens a recovery.
* ``failed_at`` is the last sign of life of what was lost: the workers' measurement once a report
  gave one (the earliest of the reports'), else the earliest lost node's (a group re-formation's
  placeholder, the old group's newest progress, gives way to the first node that joins). A
  worker measures a lost member's end (its connection closed); a member that stopped (SIGSTOP)
  or hung closes nothing, and the workers' time is then when they noticed. So when the service
  last heard from a lost node (its quietest rank's newest heartbeat, or the group's newest
  progress) more than a heartbeat period (:mod:`service.jobs.cadence`) before the workers' time,
  that sign of life is the failure (:func:`last_sign`).
* ``step_before`` is the step the group had reached: the workers' own count once a report gave
  one, else the newest of the progress and of the steps ranks reported as they stopped
  (:func:`step_reached`).
* Restarts: a recovery that restarted the workers uses one of ``max_restarts`` (in restart mode
  when it opens; in peer mode when it completes without a report, i.e. the workers fell back to
  a restart); a report of a peer or storage recovery gives it back. Peer incidents are counted
  against the spec's circuit breaker (``recovery.max_incidents``) instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from service.jobs.cadence import HEARTBEAT_S
from service.jobs.model import (
    MAX_LOST_RANKS,
    MAX_RECOVERIES,
    JobRecord,
    NodePhase,
    NodeRecord,
    Recovery,
    RecoveryKind,
)

Join = Literal["lost", "member", "replacement"]


@dataclass(frozen=True, slots=True)
class Loss:
    """A node the service saw end or go silent, and its last sign of life."""

    node: NodeRecord
    life: float


@dataclass(frozen=True, slots=True)
class Report:
    """A worker's ``recovery`` report (the fields of the contract the record keeps)."""

    phase: Literal["started", "done"]
    incident: str
    kind: RecoveryKind
    lost: tuple[str, ...] = ()
    lost_ranks: tuple[int, ...] = ()
    failed_at: float | None = None
    detected_at: float | None = None
    formed_at: float | None = None
    transferred_at: float | None = None
    first_step_at: float | None = None
    source_rank: int | None = None
    bytes_from_peers: int | None = None
    bytes_from_storage: int | None = None
    voided_windows: int | None = None
    world_before: int | None = None
    world_after: int | None = None
    step: int | None = None
    step_before: int | None = None
    last_completed_steps: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Folded:
    """What folding node losses did: the job, the losses no incident took (they open one), and
    how many replacements launched for an open incident failed (each costs a restart)."""

    job: JobRecord
    fresh: list[Loss] = field(default_factory=list)
    replacements: int = 0


def recent(recovery: Recovery, now: float, window_s: float) -> bool:
    """Open, or completed less than ``window_s`` ago."""
    return recovery.first_step_at is None or now - recovery.first_step_at < window_s


def belongs(recovery: Recovery, loss: Loss, *, now: float, window_s: float) -> Join | None:
    """How a lost node belongs to ``recovery``, if it does (see the module docstring)."""
    node = loss.node
    if node.launch_id in recovery.lost:
        return "lost"
    if not recent(recovery, now, window_s):
        return None
    began = recovery.detected_at if recovery.detected_at is not None else recovery.failed_at
    launched_after = node.launched_at is None or node.launched_at >= began  # not of the old group
    if recovery.open:
        return "replacement" if launched_after else "member"
    if recovery.reported or launched_after:
        return None
    formed = recovery.group_formed_at if recovery.group_formed_at is not None else recovery.first_step_at
    return "member" if formed is not None and loss.life <= formed else None


def fold_losses(job: JobRecord, losses: Sequence[Loss], *, now: float, window_s: float) -> Folded:
    """Attach each lost node to the incident it belongs to; the rest are ``fresh``."""
    out = Folded(job)
    for loss in losses:
        for i in range(len(out.job.recoveries) - 1, -1, -1):
            join = belongs(out.job.recoveries[i], loss, now=now, window_s=window_s)
            if join is not None:
                out.job = _replace(out.job, i, _join(out.job.recoveries[i], loss, join, now))
                out.replacements += join == "replacement"
                break
        else:
            out.fresh.append(loss)
    return out


def _join(recovery: Recovery, loss: Loss, join: Join, now: float) -> Recovery:
    lost = recovery.lost if loss.node.launch_id in recovery.lost else (*recovery.lost, loss.node.launch_id)
    update: dict[str, object] = {"lost": lost}
    if join == "member" and not recovery.reported:
        formed = recovery.group_formed_at
        if not recovery.lost:  # the placeholder of a group re-formation: the node's own sign of life
            life = max(recovery.failed_at, loss.life)
            update["failed_at"] = min(life, formed) if formed is not None else life
        else:
            update["failed_at"] = min(recovery.failed_at, loss.life)
        if formed is None or now <= formed:
            noticed = recovery.detected_at if recovery.detected_at is not None else now
            update["detected_at"] = min(now, noticed)
    return recovery.model_copy(update=update)


def open_for_losses(
    job: JobRecord, losses: Sequence[Loss], *, now: float, reason: str, charged: bool
) -> JobRecord:
    """A new incident for nodes no incident took: a preemption's when the workers reported a
    graceful stop (:func:`preempted`), which costs no restart."""
    if job.preempted_step is not None:
        return preempted(job, lost=tuple(loss.node.launch_id for loss in losses), now=now, reason=reason)
    first = min(losses, key=lambda loss: loss.life)
    recovery = Recovery(
        reason=reason,
        failed_at=first.life,
        incident=f"node:{first.node.launch_id}",
        lost=tuple(loss.node.launch_id for loss in losses),
        detected_at=now,
        step_before=step_reached(job),
        world_before=job.world_size,
        charged=charged,
        lost_ranks=job.waited_for,
    )
    return _append(job.model_copy(update={"waited_for": ()}), recovery)


def step_reached(job: JobRecord) -> int | None:
    """The step the group had reached: the newest progress, or a step a stopping rank reported
    beyond it (:attr:`~service.jobs.model.JobRecord.reached_step`)."""
    return _newest(job.last_step, job.reached_step)


def last_sign(measured: float, heard: float | None, *, beat_s: float = HEARTBEAT_S) -> float:
    """When what was lost was last alive: the workers' ``measured`` time, unless the service's
    newest sign of it (``heard``) is older by more than a beat: a stopped or hung member closes
    no connection, and the workers' time is their detection then."""
    if heard is None or measured - heard <= beat_s:
        return measured
    return heard


def open_for_reformation(
    job: JobRecord, *, group_id: str | None, last_alive: float, now: float, reason: str
) -> JobRecord:
    """A new incident for a re-formation of the group the service did not cause (a restart: it
    uses one of ``max_restarts``; after a graceful stop the workers reported, a preemption,
    which does not); ``last_alive`` is the old group's last sign of life."""
    if job.preempted_step is not None:
        job = preempted(job, lost=(), now=now, reason="the workers stopped on request (SIGTERM) and saved")
        return _update_last(job, group_formed_at=now)
    recovery = Recovery(
        reason=reason,
        failed_at=min(last_alive, now),
        incident=f"group:{group_id or '?'}",
        step_before=step_reached(job),
        group_formed_at=now,
        world_before=job.world_size,
        charged=True,
        lost_ranks=job.waited_for,
    )
    return _append(job, recovery).model_copy(update={"restarts": job.restarts + 1, "waited_for": ()})


def preempted(job: JobRecord, *, lost: tuple[str, ...], now: float, reason: str) -> JobRecord:
    """The incident of a graceful stop (kind ``preemption``): the workers saved the step they
    stopped at (``step_before``), so a resume from it loses no step; uses no restart."""
    step = job.preempted_step
    recovery = Recovery(
        reason=f"preempted at step {step}: {reason}",
        kind="preemption",
        failed_at=now,
        incident=f"preemption:{job.id}:{job.preemptions + 1}",
        lost=lost,
        detected_at=now,
        step_before=step,
        world_before=job.world_size,
        charged=False,
    )
    job = job.model_copy(update={"preempted_step": None, "preemptions": job.preemptions + 1})
    return _append(job, recovery)


def _update_last(job: JobRecord, **fields: object) -> JobRecord:
    last = len(job.recoveries) - 1
    return _replace(job, last, job.recoveries[last].model_copy(update=fields))


# ---------------------------------------------------------------------------- worker reports


def claimable(recovery: Recovery, report: Report, *, now: float, window_s: float) -> bool:
    if recovery.incident == report.incident:
        return True
    if recovery.reported or not recent(recovery, now, window_s):
        return False
    return bool(set(recovery.lost) & set(report.lost)) or (recovery.open and not recovery.lost)


def fold_report(
    job: JobRecord,
    report: Report,
    *,
    now: float,
    window_s: float,
    heard: Mapping[str, float] | None = None,
    progress_at: float | None = None,
    beat_s: float = HEARTBEAT_S,
) -> tuple[JobRecord, int]:
    """Fold a worker's report into its incident (opening one when none claims it). Returns the
    job and the index of the incident's recovery. ``heard``: by launch id, when the service last
    heard from each rank of a node (the oldest of its ranks' newest heartbeats); ``progress_at``:
    when the newest progress came. The lost nodes' last sign of life is the later of the two,
    and it moves the report's failure time earlier when older than a heartbeat period
    ``beat_s`` (:func:`last_sign`)."""
    known = {n.launch_id for n in job.nodes}
    lost = tuple(dict.fromkeys(lid for lid in report.lost if lid in known))
    report = dataclasses.replace(report, lost=lost)
    if report.failed_at is not None:
        signs = [heard[lid] for lid in lost if heard is not None and lid in heard]
        life = max(min(signs), progress_at or 0.0) if signs else None
        report = dataclasses.replace(report, failed_at=last_sign(report.failed_at, life, beat_s=beat_s))
    for i in range(len(job.recoveries) - 1, -1, -1):
        if claimable(job.recoveries[i], report, now=now, window_s=window_s):
            job, claimed = _claim(job, job.recoveries[i], report, now)
            return _replace(job, i, claimed), i
    if job.preempted_step is not None:  # the members that left had stopped on request
        job = preempted(job, lost=lost, now=now, reason="the leaving members stopped on request")
        index = len(job.recoveries) - 1
        job, claimed = _claim(job, job.recoveries[index], report, now)
        return _replace(job, index, claimed), index
    fresh = Recovery(
        reason=f"{report.kind} recovery of {', '.join(lost) or 'ranks ' + _ranks(report.lost_ranks)}",
        failed_at=report.failed_at if report.failed_at is not None else now,
        step_before=step_reached(job),
    )
    job, claimed = _claim(job, fresh, report, now)
    job = _append(job, claimed)
    return job, len(job.recoveries) - 1


def _claim(job: JobRecord, recovery: Recovery, report: Report, now: float) -> tuple[JobRecord, Recovery]:
    first = not recovery.reported
    failed_at = recovery.failed_at
    if report.failed_at is not None:
        failed_at = report.failed_at if first else min(failed_at, report.failed_at)
    detected = [t for t in (recovery.detected_at, report.detected_at) if t is not None]
    if detected:  # a failure is never later than its detection (a lost member's EOF can come late)
        failed_at = min(failed_at, *detected)
    lost_ranks = tuple(dict.fromkeys((*recovery.lost_ranks, *report.lost_ranks)))[:MAX_LOST_RANKS]
    preemption = recovery.kind == "preemption"  # the members' own re-forming after a graceful stop
    update: dict[str, object] = {
        "incident": report.incident,
        "kind": recovery.kind if preemption else report.kind,
        "reported": True,
        "failed_at": failed_at,
        "detected_at": min(detected) if detected else None,
        "lost": tuple(dict.fromkeys((*recovery.lost, *report.lost))),
        "lost_ranks": lost_ranks,
        "last_completed_steps": dict(recovery.last_completed_steps) | dict(report.last_completed_steps),
    }
    pairs = {
        "group_formed_at": report.formed_at,
        "state_loaded_at": report.transferred_at,
        "resumed_step": report.step,
        "source_rank": report.source_rank,
        "bytes_from_peers": report.bytes_from_peers,
        "bytes_from_storage": report.bytes_from_storage,
        "voided_windows": report.voided_windows,
        "world_before": report.world_before,
        "world_after": report.world_after,
        # the workers' count; the service's (its newest progress) lags it, never passes it
        "step_before": _newest(recovery.step_before, report.step_before),
    }
    update |= {k: v for k, v in pairs.items() if v is not None}
    if report.phase == "done":
        update["first_step_at"] = report.first_step_at if report.first_step_at is not None else now
    if first and report.kind != "restart" and not preemption:
        job = job.model_copy(update={"peer_incidents": job.peer_incidents + 1})
    if recovery.charged and report.kind != "restart":  # a peer or storage recovery: no restart used
        job = job.model_copy(update={"restarts": max(0, job.restarts - 1)})
        update["charged"] = False
    return job, recovery.model_copy(update=update)


def _newest(*steps: int | None) -> int | None:
    known = [s for s in steps if s is not None]
    return max(known) if known else None


def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "") if ranks else "unknown"


# ---------------------------------------------------------------------------- shared


def close(job: JobRecord, index: int, first_step_at: float, *, resumed_step: int | None = None) -> JobRecord:
    """The repaired group's first step. In peer mode, an incident no worker reported was a
    restart of the workers: it uses one of ``max_restarts`` now, unless it was a preemption (the
    whole job stopped on request and saved)."""
    recovery = job.recoveries[index]
    update: dict[str, object] = {"first_step_at": first_step_at}
    if resumed_step is not None and recovery.resumed_step is None:
        update["resumed_step"] = resumed_step
    if (
        job.recovery_mode == "peer"
        and not recovery.reported
        and not recovery.charged
        and recovery.kind != "preemption"
    ):
        update["charged"] = True
        job = job.model_copy(update={"restarts": job.restarts + 1})
    job = job.model_copy(update={"reached_step": None})  # the new group counts from its own start
    return _replace(job, index, recovery.model_copy(update=update))


def completed(job: JobRecord) -> tuple[JobRecord, list[Recovery]]:
    """Recoveries that completed since the metrics last took them: marked taken, and returned
    (the caller observes them after the record with the marks is written)."""
    done = [r for r in job.recoveries if not r.open and not r.observed]
    if not done:
        return job, []
    marked = tuple(
        r if r.open or r.observed else r.model_copy(update={"observed": True}) for r in job.recoveries
    )
    return job.model_copy(update={"recoveries": marked}), done


def planned(job: JobRecord, lost: Sequence[str]) -> bool:
    """Every lost launch id is a node the service itself stopped (a scale-down): the re-formation
    that follows is the rescale, not an incident."""
    stopped = {n.launch_id for n in job.nodes if n.phase in (NodePhase.STOPPING, NodePhase.STOPPED)}
    return bool(lost) and set(lost) <= stopped


def _append(job: JobRecord, recovery: Recovery) -> JobRecord:
    return job.model_copy(update={"recoveries": (*job.recoveries, recovery)[-MAX_RECOVERIES:]})


def _replace(job: JobRecord, index: int, recovery: Recovery) -> JobRecord:
    recoveries = list(job.recoveries)
    recoveries[index] = recovery
    return job.model_copy(update={"recoveries": tuple(recoveries)})
