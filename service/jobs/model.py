"""The job record: what etcd holds about one job, and the values the state machine trades in.

Records are frozen pydantic models serialised as JSON; a change is a ``model_copy`` that the
caller writes back with a compare-and-set on the key's mod_revision. A record carries its spec
as the :class:`~worker.jobspec.spec.JobSpec` value (parsed once, at the API's edge), stored as the
spec's JSON with its aliases, as submitted. :meth:`JobRecord.from_json` is the one place a
stored record is decoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer

from worker.jobspec.location import S3Location, parse_location
from worker.jobspec.spec import JobSpec

MAX_EVENTS = 50
MAX_RECOVERIES = 20
MAX_LOST_RANKS = 256
"""Lost ranks kept per recovery (a worker may report up to 1024; the record stays small)."""

RecoveryMode = Literal["peer", "restart"]
"""How a job recovers (:mod:`service.jobs.peer`): from its peers' memory, or by torchrun's restart."""
RecoveryKind = Literal["peer", "storage", "restart", "preemption"]
"""Which recovery happened: state from a peer's memory, from the checkpoint in process, a
restart of the workers (torchrun's, or the service's relaunch), or a relaunch after a graceful
stop on request (a SIGTERM: the workers saved the step they reached; it uses no restart)."""
NodeRole = Literal["member", "spare"]
"""A node app of the job's group (one per slot), or a warm spare outside it (peer mode)."""


class JobState(StrEnum):
    PENDING = "PENDING"
    QUEUED = "QUEUED"
    """Waiting for free slots on the local scheduler (:mod:`service.jobs.queue`)."""
    LAUNCHING = "LAUNCHING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    RESCALING = "RESCALING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


class NodePhase(StrEnum):
    """One node = one torchrun agent app.

    LAUNCHING: the launch intent is recorded, no handle yet. RUNNING: launched, handle known.
    STOPPING: a cancel was issued and is repeated until the scheduler no longer says running.
    SUCCEEDED / FAILED / LOST / STOPPED: ended (LOST: no heartbeat or unknown to the scheduler).
    """

    LAUNCHING = "launching"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"
    STOPPED = "stopped"

    @property
    def active(self) -> bool:
        """Counts towards the job's node count (launching or running)."""
        return self in (NodePhase.LAUNCHING, NodePhase.RUNNING)

    @property
    def ended(self) -> bool:
        return self in (NodePhase.SUCCEEDED, NodePhase.FAILED, NodePhase.LOST, NodePhase.STOPPED)


NodeState = Literal["running", "succeeded", "failed", "unknown"]


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What a scheduler says about one node app (the value the state machine reasons about and
    every scheduler returns). ``exit_code`` is known for ended local nodes (``128 + signal``
    when killed) and is ``0`` for any succeeded node; ``ended_at`` (Unix time) is when an ended
    node's torchrun agent ended, where the scheduler recorded it (local nodes): it says when, not
    what, and two statuses that differ only in it are equal."""

    state: NodeState
    exit_code: int | None = None
    message: str = ""
    ended_at: float | None = field(default=None, compare=False)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class NodeRecord(_Frozen):
    """One launch of one node app. A member's ``index`` is its slot (``0 .. max_nodes - 1``); a
    spare's is ``max_nodes + k`` for the k-th spare place, until it is promoted into a slot."""

    index: int
    role: NodeRole = "member"
    attempt: int = 0
    launch_id: str
    phase: NodePhase = NodePhase.LAUNCHING
    handle: str | None = None
    exit_code: int | None = None
    launched_at: float | None = None
    ended_at: float | None = None


class JobEvent(_Frozen):
    time: float
    kind: str
    message: str


class Recovery(_Frozen):
    """One incident: a failure and the recovery it caused, from the last sign of life of what was
    lost to the first step of the repaired group (:mod:`service.jobs.incidents` folds the
    service's own observations and the workers' reports into it).

    ``failed_at``: the last sign of life of what was lost: a worker's measurement when a worker
    reported the incident (``reported``), else the service's (a lost node's end time as its
    scheduler recorded it, else its newest heartbeat or the group's newest progress).
    ``detected_at``: when the failure was noticed (a survivor or the service).
    ``state_loaded_at``: the state was in place (transferred from a peer, or restored)."""

    reason: str
    failed_at: float
    incident: str = ""
    """The workers' incident id, or ``node:<launch id>`` / ``group:<group id>`` while only the
    service has seen it."""
    kind: RecoveryKind = "restart"
    reported: bool = False
    """A worker's ``recovery`` report describes it: its times and kind are measured, not guessed."""
    lost: tuple[str, ...] = ()
    """Launch ids of the node apps lost in it."""
    lost_ranks: tuple[int, ...] = ()
    last_completed_steps: dict[str, int] = Field(default_factory=dict)
    """The last step each lost rank completed (rank -> step), as the workers reported it."""
    detected_at: float | None = None
    step_before: int | None = None
    group_formed_at: float | None = None
    state_loaded_at: float | None = None
    resumed_step: int | None = None
    first_step_at: float | None = None
    source_rank: int | None = None
    bytes_from_peers: int = 0
    bytes_from_storage: int = 0
    voided_windows: int = 0
    world_before: int | None = None
    world_after: int | None = None
    charged: bool = False
    """It used one of the job's ``max_restarts``."""
    observed: bool = False
    """Its numbers went into the metrics (once, when it completed)."""

    @property
    def seconds(self) -> float | None:
        """Failure -> first finished step after resume, or None while in progress."""
        return None if self.first_step_at is None else max(0.0, self.first_step_at - self.failed_at)

    @property
    def open(self) -> bool:
        return self.first_step_at is None

    @property
    def steps_lost(self) -> int | None:
        """Steps trained again: the newest step before the failure less the one resumed from."""
        if self.step_before is None or self.resumed_step is None:
            return None
        return max(0, self.step_before - self.resumed_step)


class JobRecord(_Frozen):
    id: str
    name: str
    spec: JobSpec | None
    """The job's spec; None only in the FAILED stand-in of a record whose stored spec could not be
    read (:mod:`service.jobs.salvage`)."""
    spec_hash: str
    state: JobState = JobState.PENDING
    state_since: float
    desired_nodes: int
    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    checkpoint_dir: str
    recovery_mode: RecoveryMode = "restart"
    spares: int = 0
    """Warm spare node apps kept beside the members (peer mode)."""
    max_incidents: int | None = None
    """Peer incidents allowed before the job fails (None: no limit)."""
    desired_epoch: int = 0
    """Grows with every change of the desired size the workers are told (etcd ``desired``)."""
    worker_token_hash: str
    nodes: tuple[NodeRecord, ...] = ()
    next_attempt: dict[int, int] = Field(default_factory=dict)
    """Per node slot, the next launch attempt number (kept when old nodes are pruned)."""
    restarts: int = 0
    """Recoveries that restarted the workers (they use ``max_restarts``); peer ones do not."""
    peer_incidents: int = 0
    spare_failures: int = 0
    preemptions: int = 0
    """Graceful stops on request (SIGTERM) the job went through; they use no restart."""
    preempted_step: int | None = None
    """A worker reported a graceful stop at this step that no incident took yet: the node losses
    or the re-formation that follow it are that preemption's."""
    waited_for: tuple[int, ...] = ()
    """The ranks a worker's timed-out collective waited for (its ``failed`` report), for the
    incident it causes (its ``lost_ranks``): the open one, else the next."""
    cancel_requested: bool = False
    world_size: int | None = None
    last_step: int | None = None
    reached_step: int | None = None
    """The newest step a rank of the current group said it had completed when it stopped (its
    ``failed`` report): the newest progress lags the group by up to its reporting period, so a
    recovery's ``step_before`` takes the larger (:func:`service.jobs.incidents.step_reached`).
    Cleared when a recovery completes."""
    last_published_step: int | None = None
    last_group_id: str | None = None
    groups_formed: int = 0
    reason: str | None = None
    queue_position: int | None = None
    """Its place in the local scheduler's queue (1: next) while QUEUED."""
    waiting: str | None = None
    """Why it waits for slots: to start (QUEUED), or to grow to its desired size."""
    events: tuple[JobEvent, ...] = ()
    recoveries: tuple[Recovery, ...] = ()
    created_at: float
    updated_at: float
    finished_at: float | None = None

    @field_serializer("spec")
    def _spec_as_submitted(self, spec: JobSpec | None) -> dict[str, Any] | None:
        return None if spec is None else spec.model_dump(mode="json", by_alias=True)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, raw: bytes) -> JobRecord:
        """Decode a stored record: the one place that does. Readers of etcd's job keys go through
        :func:`service.jobs.salvage.decode`, which turns a record this raises for into a FAILED
        stand-in."""
        return cls.model_validate_json(raw)

    @property
    def active_nodes(self) -> tuple[NodeRecord, ...]:
        return tuple(n for n in self.nodes if n.phase.active)

    @property
    def members(self) -> tuple[NodeRecord, ...]:
        """Active member nodes (the group's slots; spares left out)."""
        return tuple(n for n in self.nodes if n.phase.active and n.role == "member")

    @property
    def checkpoint_place(self) -> Path | S3Location:
        """Where the job's checkpoints live: a directory, or an ``s3://`` location."""
        return parse_location(self.checkpoint_dir) or Path(self.checkpoint_dir)

    @property
    def current_recovery(self) -> Recovery | None:
        last = self.recoveries[-1] if self.recoveries else None
        return last if last is not None and last.open else None

    def with_event(self, now: float, kind: str, message: str) -> JobRecord:
        events = (*self.events, JobEvent(time=now, kind=kind, message=message))[-MAX_EVENTS:]
        return self.model_copy(update={"events": events, "updated_at": now})


class Progress(_Frozen):
    """The newest training progress a worker (rank 0) reported; last writer wins."""

    step: int = Field(ge=0)
    samples_seen: int | None = None
    samples_per_s: float | None = None
    loss: float | None = None
    world_size: int | None = None
    time: float


def launch_id(job_id: str, index: int, attempt: int) -> str:
    """A name unique to one launch of one node slot (usable as an app name)."""
    return f"{job_id}-n{index}-a{attempt}"
