"""What worker reports do to a job record, pure.

Workers tell the service what only they can see: the group re-formed (after torchrun restarted
it), the state was loaded, the first step after resume finished; in peer mode that a
recovery started and ended (``recovery``, with its measured phases) and that a spare took a lost
member's slot (``spare_promoted``). These close the loop of a recovery (RECOVERING -> RUNNING) or
a rescale (RESCALING -> RUNNING), and a re-formation the service did not cause (a worker process
died and torchrun restarted the group) opens one. Which incident a report belongs to is
:mod:`service.jobs.incidents`'s rule.

A rank that stops says why (``failed``: one line, the step, its attempt). The same line at the
same step from the next attempt is an error that restarting will not fix (a model that does not
fit the worker, a bad sample, a bug): the job fails with that line at once instead of spending
the rest of ``max_restarts`` on it. A rank that says a restart cannot help (``restartable``
False: its final checkpoint could not be published, so the run's output does not exist) fails
the job with its line at once. Reports of one attempt's ranks are recorded once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.jobs import incidents, slots
from service.jobs.cadence import HEARTBEAT_S
from service.jobs.machine import Policy, fail, move
from service.jobs.model import JobRecord, JobState, Progress, RecoveryKind

S = JobState
WorkerEventKind = Literal[
    "group_formed",
    "state_loaded",
    "first_step",
    "failed",
    "finished",
    "log",
    "recovery",
    "spare_promoted",
    "preempted",
    "straggler",
    "straggler_replaced",
    "straggler_kept",
    "straggler_left",
    "replica_mismatch",
]
STRAGGLER_REPLACE = ("straggler_replaced", "straggler_kept", "straggler_left")
"""``stragglers.action: replace``: the group's choice (rank 0) and the leaving rank's own word."""
WINDOW_S = Policy().merge_window_s
MAX_TIME = 1e11
"""The largest time stamp a worker may send (Unix seconds; the year 5138)."""
LaunchId = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[a-z0-9-]+$")]
Time = Annotated[float, Field(gt=0, lt=MAX_TIME, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0, le=1 << 62)]
RankKey = Annotated[str, Field(pattern=r"^[0-9]{1,6}$")]


class WorkerEvent(BaseModel):
    """A worker's report. ``group_formed`` is sent once per formation by global rank 0 with a
    ``group_id`` unique to that formation (repeats with the same id are ignored).

    ``recovery`` (peer mode, the new generation's rank 0): ``phase`` ``started`` right after the
    repaired group formed, ``done`` after its first committed step; ``incident`` names it,
    ``recovery_kind`` says which recovery it was, ``lost`` / ``lost_ranks`` what was lost, the
    ``*_at`` fields when each phase ended (Unix seconds), ``step`` the committed step the group
    resumes from, ``step_before`` the step it had reached. ``state_loaded`` (restart mode):
    ``step`` the step restored, ``bytes_from_storage`` the bytes the restore read.
    ``spare_promoted``: the spare ``launch_id`` now fills slot ``node_index``.
    ``replica_mismatch``: the data-parallel replicas disagreed after ``step`` (``message`` names
    the ranks and tensors); the ranks' ``failed`` reports that follow open the incident."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: WorkerEventKind
    rank: int | None = Field(default=None, ge=0, le=100_000)
    node_index: int | None = Field(default=None, ge=0, le=100_000)
    group_id: str | None = Field(default=None, max_length=200)
    world_size: int | None = Field(default=None, gt=0, le=100_000)
    restart_count: int | None = Field(default=None, ge=0, le=1 << 31)
    step: int | None = Field(default=None, ge=0, le=1 << 62)
    message: str = Field(default="", max_length=2000)
    phase: Literal["started", "done"] | None = None
    incident: str | None = Field(default=None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:/-]+$")
    recovery_kind: RecoveryKind | None = None
    lost: list[LaunchId] = Field(default_factory=list, max_length=64)
    lost_ranks: list[Annotated[int, Field(ge=0, le=100_000)]] = Field(default_factory=list, max_length=1024)
    failed_at: Time | None = None
    detected_at: Time | None = None
    formed_at: Time | None = None
    transferred_at: Time | None = None
    first_step_at: Time | None = None
    source_rank: int | None = Field(default=None, ge=0, le=100_000)
    bytes_from_peers: Count | None = None
    bytes_from_storage: Count | None = None
    voided_windows: int | None = Field(default=None, ge=0, le=1 << 31)
    world_before: int | None = Field(default=None, ge=1, le=100_000)
    world_after: int | None = Field(default=None, ge=1, le=100_000)
    step_before: int | None = Field(default=None, ge=0, le=1 << 62)
    """``recovery``: the step the group had reached when it failed (the reporter's own count)."""
    last_completed_steps: dict[RankKey, Count] = Field(default_factory=dict, max_length=1024)
    """``recovery``: the last step each lost rank completed (rank -> step), as its beacon last said."""
    launch_id: LaunchId | None = None
    restartable: bool = True
    """``failed``: False when a restart cannot help (the run trained to its end and its final
    checkpoint could not be published): the job fails at once with the rank's line."""


def apply_worker_event(
    job: JobRecord,
    event: WorkerEvent,
    now: float,
    *,
    progress_at: float | None = None,
    window_s: float = WINDOW_S,
    heard: Mapping[str, float] | None = None,
    beat_s: float = HEARTBEAT_S,
) -> JobRecord:
    """Fold one worker event into the record. Events for a finished job change nothing.
    ``progress_at``: when the newest progress came (the old group's last sign of life);
    ``window_s``: how long a completed incident still takes late reports of it; ``heard``: by
    launch id, when each node's quietest rank last sent a heartbeat (a lost node's last sign of
    life: see :func:`service.jobs.incidents.fold_report`), ``beat_s`` apart."""
    if job.state.terminal:
        return job
    if event.kind == "group_formed":
        return _group_formed(job, event, now, progress_at=progress_at)
    if event.kind == "state_loaded":
        job = _update_recovery(
            job, state_loaded_at=now, resumed_step=event.step, bytes_from_storage=event.bytes_from_storage
        )
        return job.with_event(now, "worker", f"state loaded at step {event.step}")
    if event.kind == "first_step":
        if job.preempted_step is not None:  # a stop no incident followed (a rescale's): over
            job = job.model_copy(update={"preempted_step": None})
        return first_step_done(job, event.step, now, new_group=True)
    if event.kind == "failed":
        return _failed(job, event, now)
    if event.kind == "recovery":
        return _recovery(
            job, event, now, window_s=window_s, heard=heard, progress_at=progress_at, beat_s=beat_s
        )
    if event.kind == "spare_promoted":
        return _spare_promoted(job, event, now)
    if event.kind == "preempted":
        return _preempted(job, event, now)
    if event.kind == "straggler":  # the group names a slow rank; nothing changes but the log
        return job.with_event(now, "straggler", event.message or f"rank {event.rank} is a straggler")
    if event.kind in STRAGGLER_REPLACE:  # the node's loss that follows is the group's peer recovery
        return job.with_event(now, event.kind, event.message or f"rank {event.rank} at step {event.step}")
    if event.kind == "replica_mismatch":  # the workers' failure that follows opens the incident
        return job.with_event(now, "replica_mismatch", event.message or f"at step {event.step}")
    who = f"rank {event.rank}" if event.rank is not None else "worker"
    return job.with_event(now, f"worker_{event.kind}", f"{who}: {event.message}".strip(": "))


def merge_progress(job: JobRecord, progress: Progress | None) -> JobRecord:
    """The newest progress report's step (and world size) in the record. Progress lives under its
    own key (written far more often than the record); a recovery counts the steps it lost from the
    record's ``last_step``, so every writer of the record merges the newest step first."""
    if progress is None or progress.step == job.last_step:
        return job
    return job.model_copy(
        update={"last_step": progress.step, "world_size": progress.world_size or job.world_size}
    )


def first_step_done(
    job: JobRecord, step: int | None, now: float, *, world_size: int | None = None, new_group: bool = False
) -> JobRecord:
    """A step finished after a (re-)formation: a recovery or rescale is over.

    ``new_group``: the workers' own ``first_step`` event, sent by a group that just formed.
    Otherwise (a progress report) a rescale is over only once the progress comes at the target
    world size: until the new nodes join, the old group keeps training and reporting; and a
    recovery a worker reported is over only once the progress is past the step it resumed from
    (its ``done`` report says when exactly)."""
    if job.state not in (S.RECOVERING, S.RESCALING):
        return job
    if job.state == S.RESCALING and not new_group and world_size != job.desired_nodes * job.nproc_per_node:
        return job
    recovery = job.current_recovery
    if job.state == S.RECOVERING and recovery is not None:
        if recovery.reported and not new_group and not _past(recovery.resumed_step, step):
            return job
        resumed = max(0, step - 1) if step is not None else None
        job = incidents.close(job, len(job.recoveries) - 1, now, resumed_step=resumed)
    return move(job, S.RUNNING, now)


def _past(resumed: int | None, step: int | None) -> bool:
    return resumed is not None and step is not None and step > resumed


def _group_formed(job: JobRecord, event: WorkerEvent, now: float, *, progress_at: float | None) -> JobRecord:
    if event.group_id is not None and event.group_id == job.last_group_id:
        return job
    reformed = job.groups_formed > 0
    grew = bool(event.world_size and job.world_size and event.world_size > job.world_size)
    job = job.model_copy(
        update={
            "groups_formed": job.groups_formed + 1,
            "last_group_id": event.group_id,
            "world_size": event.world_size or job.world_size,
        }
    )
    job = job.with_event(now, "worker", f"worker group formed with world size {event.world_size}")
    if reformed and job.state == S.RUNNING and grew:  # a node joined (a replacement): not a failure
        return move(job, S.RESCALING, now, reason=f"a node joined the group (world size {event.world_size})")
    if reformed and job.state == S.RUNNING:
        reason = "the worker group re-formed (a worker process died and torchrun restarted the group)"
        since = job.state_since if progress_at is None else max(progress_at, job.state_since)
        job = incidents.open_for_reformation(
            job, group_id=event.group_id, last_alive=since, now=now, reason=reason
        )
        return move(job, S.RECOVERING, now, reason=reason)
    if job.state == S.RECOVERING:
        job = _update_recovery(job, group_formed_at=now)
    return job


def _recovery(
    job: JobRecord,
    event: WorkerEvent,
    now: float,
    *,
    window_s: float,
    heard: Mapping[str, float] | None,
    progress_at: float | None,
    beat_s: float,
) -> JobRecord:
    """A worker's ``recovery`` report (see :mod:`service.jobs.incidents` for the merge rules). A
    re-formation that only drops nodes the service stopped is the rescale, not an incident."""
    if event.phase is None or event.incident is None or event.recovery_kind is None:
        return job.with_event(now, "worker_recovery", "a recovery report without phase, incident or kind")
    if incidents.planned(job, event.lost):
        return job.with_event(
            now, "worker", f"the group re-formed without the stopped {', '.join(event.lost)}"
        )
    report = incidents.Report(
        phase=event.phase, incident=event.incident, kind=event.recovery_kind, lost=tuple(event.lost),
        lost_ranks=tuple(event.lost_ranks), failed_at=event.failed_at, detected_at=event.detected_at,
        formed_at=event.formed_at, transferred_at=event.transferred_at, first_step_at=event.first_step_at,
        source_rank=event.source_rank, bytes_from_peers=event.bytes_from_peers,
        bytes_from_storage=event.bytes_from_storage, voided_windows=event.voided_windows,
        world_before=event.world_before, world_after=event.world_after, step=event.step,
        step_before=event.step_before, last_completed_steps=dict(event.last_completed_steps),
    )  # fmt: skip
    before = job.peer_incidents
    job, index = incidents.fold_report(
        job, report, now=now, window_s=window_s, heard=heard, progress_at=progress_at, beat_s=beat_s
    )
    recovery = job.recoveries[index]
    what = f"{recovery.kind} recovery {recovery.incident} {event.phase}"
    job = job.with_event(now, "recovery", f"{what}: lost {', '.join(recovery.lost) or 'no node'}")
    if (
        job.peer_incidents > before
        and job.max_incidents is not None
        and job.peer_incidents > job.max_incidents
    ):
        reason = (
            f"{job.peer_incidents} peer recoveries, more than recovery.max_incidents "
            f"{job.max_incidents} allows (raise it, or find why ranks keep failing)"
        )
        return fail(job, now, reason=reason)
    latest = index == len(job.recoveries) - 1
    if latest and recovery.open and job.state in (S.RUNNING, S.RESCALING, S.LAUNCHING):
        return move(job, S.RECOVERING, now, reason=recovery.reason)
    if latest and not recovery.open and job.state == S.RECOVERING:
        return move(job, S.RUNNING, now)
    return job


def _preempted(job: JobRecord, event: WorkerEvent, now: float) -> JobRecord:
    """The workers stopped on request (a SIGTERM: an eviction, a drained or reclaimed node) at
    ``step`` and saved it: the node losses or the re-formation that follow are a preemption
    (:func:`service.jobs.incidents.preempted`), which uses no restart. A cancel or a scale-down
    stops workers the same way; what the service asked for is not an incident."""
    what = f"the workers stopped on request at step {event.step}: {event.message}"
    job = job.with_event(now, "preempted", what)
    if job.cancel_requested or event.step is None:
        return job
    return job.model_copy(update={"preempted_step": event.step})


def _spare_promoted(job: JobRecord, event: WorkerEvent, now: float) -> JobRecord:
    if event.launch_id is None or event.node_index is None:
        return job.with_event(now, "spare", "a spare_promoted report without launch_id or node_index")
    return slots.promote(job, event.launch_id, event.node_index, now)


def _update_recovery(job: JobRecord, **fields: object) -> JobRecord:
    recovery = job.current_recovery
    if recovery is None:
        return job
    changed = recovery.model_copy(update={k: v for k, v in fields.items() if v is not None})
    return job.model_copy(update={"recoveries": (*job.recoveries[:-1], changed)})


FAILED_KIND = "worker_failed"
_FAILURE_RE = re.compile(
    r"^(?:rank \d+|a rank) at (?P<where>step \d+|start-up) \[attempt (?P<attempt>[^\]]*)\]: (?P<line>.*)$",
    re.S,
)


@dataclass(frozen=True, slots=True)
class Failure:
    """One rank's ``failed`` report as the job's event log keeps it."""

    attempt: str
    where: str
    line: str

    @staticmethod
    def of(event: WorkerEvent) -> Failure:
        where = "start-up" if event.step is None else f"step {event.step}"
        attempt = (event.group_id or "").replace("]", ")")
        return Failure(attempt=attempt, where=where, line=event.message.strip())

    def entry(self, rank: int | None) -> str:
        who = f"rank {rank}" if rank is not None else "a rank"
        return f"{who} at {self.where} [attempt {self.attempt}]: {self.line}"

    @staticmethod
    def parse(message: str) -> Failure | None:
        match = _FAILURE_RE.match(message)
        if match is None:
            return None
        return Failure(attempt=match["attempt"], where=match["where"], line=match["line"])


def recorded_failures(job: JobRecord) -> list[Failure]:
    """The ``failed`` reports the job's event log still holds, oldest first."""
    found = (Failure.parse(e.message) for e in job.events if e.kind == FAILED_KIND)
    return [f for f in found if f is not None]


def repeated(failure: Failure, earlier: list[Failure]) -> Failure | None:
    """The report of the latest attempt before ``failure``'s that stopped with the same line at
    the same step, if that attempt did (pure)."""
    others = [f for f in earlier if f.attempt != failure.attempt]
    if not failure.attempt or not others:
        return None
    previous = others[-1].attempt
    same = [f for f in others if f.attempt == previous and (f.where, f.line) == (failure.where, failure.line)]
    return same[0] if same else None


def _waited_for(job: JobRecord, ranks: tuple[int, ...]) -> JobRecord:
    """The open incident takes the ranks; else the next one will."""
    recovery = job.current_recovery
    if job.state == S.RECOVERING and recovery is not None and recovery.open and not recovery.lost_ranks:
        return _update_recovery(job, lost_ranks=ranks)
    return job.model_copy(update={"waited_for": ranks})


def _failed(job: JobRecord, event: WorkerEvent, now: float) -> JobRecord:
    """Record a rank's failure once per attempt and line; fail the job when the attempt before
    stopped the same way (see the module docstring)."""
    failure = Failure.of(event)
    if event.lost_ranks:  # a timed-out collective named the ranks it waited for
        job = _waited_for(job, tuple(event.lost_ranks))
    earlier = recorded_failures(job)
    if event.step is not None and event.step > (job.reached_step or 0):  # the step it completed
        job = job.model_copy(update={"reached_step": event.step})
    if not failure.line or failure in earlier:
        return job  # another rank of the same attempt said the same
    job = job.with_event(now, FAILED_KIND, failure.entry(event.rank))
    if not event.restartable:
        return fail(job, now, reason=failure.entry(event.rank))
    before = repeated(failure, earlier)
    if before is None:
        return job
    reason = (
        f"the same error at {failure.where} in two attempts in a row ({before.attempt}, "
        f"{failure.attempt}), which a restart will not fix: {failure.line}"
    )
    return fail(job, now, reason=reason)
