"""Request and response bodies of the REST API (the JobSpec itself is worker/jobspec/spec.py)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

from service.api.errors import ApiError
from service.checkpoints.results import CheckpointEntry
from service.jobs.events import WorkerEvent, merge_progress
from service.jobs.model import JobEvent, JobRecord, JobState, NodePhase, Progress, Recovery
from service.jobs.recovery import phases_of
from worker.errors import SpecError
from worker.jobspec.spec import JobSpec, describe


def body_of(component: str) -> dict[str, Any]:
    """An OpenAPI ``requestBody`` for a route that reads and validates its body itself (so that
    a client that omits ``Content-Type`` is still understood); ``component`` is one of the
    models that app.py puts into the schema's components."""
    ref = {"$ref": f"#/components/schemas/{component}"}
    return {"content": {"application/json": {"schema": ref}}, "required": True}


_DECIMAL = re.compile(r"-?[0-9]{1,19}")


def _decimal(value: object) -> object:
    """A path or query integer as people write one: decimal digits. (Left to pydantic, a
    parameter also took '+0.0', '1_000' or ' 7', which no client means as a number.)"""
    if isinstance(value, str) and not _DECIMAL.fullmatch(value):
        raise ValueError(f"{value[:40]!r} is not a whole number; give decimal digits, e.g. 12")
    return value


ParamInt = Annotated[int, BeforeValidator(_decimal)]
"""The type of every integer path and query parameter."""


def spec_from_body(body: bytes) -> JobSpec:
    """The JobSpec a request body holds, parsed once (the JSON and the spec together): 400
    ``malformed_json`` when the body is not JSON, :class:`SpecError` (422, naming the field)
    when it is JSON but not a valid spec. The spec travels on as this value."""
    try:
        return JobSpec.model_validate_json(body)
    except ValidationError as exc:
        broken = next((e for e in exc.errors() if e["type"] == "json_invalid"), None)
        if broken is not None:
            message = f"the request body is not valid JSON ({broken['msg']}); send a JobSpec"
            raise ApiError(400, "malformed_json", message) from None
        if any(e["type"] == "model_type" and not e["loc"] for e in exc.errors()):
            message = "the request body must be one JSON object, a JobSpec, not a list or a value"
            raise ApiError(422, "invalid_spec", message, field="body") from None
        raise SpecError(describe(exc)) from None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ScaleRequest(_Request):
    nodes: int = Field(ge=1, le=10_000, description="Desired node count, within the job's min:max.")


MAX_COUNT = 1 << 62
"""The largest step or sample count a worker may send."""
MAX_ROUND = 1 << 62
"""The largest generation or save number (``seq``) a worker may send (a generation is agreed
from the clock in milliseconds: about 1.8e12 today)."""


class HeartbeatRequest(_Request):
    launch_id: str = Field(min_length=1, max_length=200, pattern=r"^[a-z0-9-]+$")
    local_rank: int = Field(ge=0, le=1024)
    step: int | None = Field(default=None, ge=0, le=MAX_COUNT)


class WorkerEventRequest(WorkerEvent):
    """A worker's event as the API takes it: :class:`WorkerEvent`, strictly typed (``false`` is
    not a restart count, ``"3"`` is not a rank) and with no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ProgressRequest(_Request):
    step: int = Field(ge=0, le=MAX_COUNT)
    samples_seen: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    samples_per_s: float | None = Field(default=None, ge=0, le=1e15)
    loss: float | None = None
    world_size: int | None = Field(default=None, ge=1, le=100_000)


MAX_WORLD_SIZE = 100_000
"""The largest world size the API takes (a report or a resume for more ranks is refused, 422):
phase 2 enumerates the ranks of a round, so an unbounded one would exhaust memory."""
Count = Annotated[StrictInt, Field(ge=0)]
Name = Annotated[StrictStr, Field(max_length=1024)]
FileReport = tuple[Count, Name]
"""A staged file: size in bytes, digest."""
PieceReport = tuple[StrictStr, StrictStr, Count, Count, tuple[Count, Count], list[StrictStr]]
"""A tensor piece: tensor name, file, offset, bytes, rows [start, stop), digests."""
TensorReport = tuple[StrictStr, list[Count], StrictStr, Count | None]
"""A tensor header: dtype, shape, kind, owner rank (or null)."""


class ReportContext(BaseModel):
    """What rank 0 adds for the manifest (other ranks send ``{}``); unknown keys pass through."""

    model_config = ConfigDict(extra="allow", frozen=True)

    job: StrictStr = ""
    parallelism: StrictStr = "ddp"
    block_size: Count = 0
    meta: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, StrictFloat] = Field(default_factory=dict)
    run_record: dict[str, Any] = Field(default_factory=dict)
    parent_step: Count | None = None
    spec_hash: StrictStr = ""
    data_version: StrictStr = ""


class CheckpointReportRequest(BaseModel):
    """One rank's phase-1 report: the JSON of ``worker.checkpoint.commit.report_to_json``. The
    shape is checked here so that nothing malformed reaches the coordinator; whether the report
    is consistent (rank below world size, files on disk) is the coordinator's to judge."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: Annotated[StrictInt, Field(ge=0, le=MAX_COUNT)]
    generation: Annotated[StrictInt, Field(ge=0, le=MAX_ROUND)]
    rank: Annotated[StrictInt, Field(ge=0, lt=MAX_WORLD_SIZE)]
    world_size: Annotated[StrictInt, Field(ge=1, le=MAX_WORLD_SIZE)]
    ok: StrictBool
    error: Annotated[StrictStr, Field(max_length=2000)] = ""
    files: dict[Name, FileReport] = Field(default_factory=dict)
    pieces: list[PieceReport] = Field(default_factory=list)
    tensors: dict[Name, TensorReport] = Field(default_factory=dict)
    meta_digest: Annotated[StrictStr, Field(max_length=200)] = ""
    rank_meta: dict[str, Any] = Field(default_factory=dict)
    context: ReportContext = Field(default_factory=ReportContext)


class NodePublic(BaseModel):
    index: int
    launch_id: str = Field(description="This launch of the node app (ELASTRAIN_LAUNCH_ID).")
    role: Literal["member", "spare"] = Field(
        description="A member of the group (index = its slot) or a warm spare."
    )
    attempt: int
    phase: NodePhase
    handle: str | None
    exit_code: int | None
    launched_at: float | None
    ended_at: float | None


class PhasePublic(BaseModel):
    name: str = Field(
        description="detect, reform, transfer (peer) or restore, first_step; '+' joins unmeasured ones."
    )
    seconds: float


class RecoveryPublic(BaseModel):
    """One incident: a failure and its recovery. A failure that costs several restarts or re-forms
    is still one incident, so each incident is exactly one recovery."""

    incident: str = Field(
        description="The workers' incident id, or node:<launch id> / group:<id> (service-seen)."
    )
    kind: Literal["peer", "storage", "restart", "preemption"] = Field(
        description=(
            "State from a peer's memory, from the checkpoint in process, a restart of the workers, "
            "or a relaunch after a graceful stop on request (SIGTERM; uses no restart)."
        )
    )
    reported: bool = Field(description="A worker's recovery report measured it.")
    reason: str
    lost: list[str] = Field(description="Launch ids of the node apps lost in it.")
    lost_ranks: list[int]
    last_completed_steps: dict[str, int] = Field(
        description="The last step each lost rank completed (rank -> step), when the workers reported it."
    )
    failed_at: float = Field(description="The last sign of life of what was lost (Unix seconds).")
    detected_at: float | None
    step_before: int | None
    resumed_step: int | None
    group_formed_at: float | None
    state_loaded_at: float | None = Field(description="State in place: transferred from a peer, or restored.")
    first_step_at: float | None
    source_rank: int | None
    bytes_from_peers: int
    bytes_from_storage: int
    voided_windows: int
    world_before: int | None
    world_after: int | None
    charged: bool = Field(description="It used one of max_restarts (peer recoveries do not).")
    seconds: float | None = Field(description="Failure to the first finished step after resume.")
    steps_lost: int | None = Field(description="Steps trained again (rolled back).")
    phases: list[PhasePublic]


class JobSummary(BaseModel):
    id: str
    name: str
    state: JobState
    desired_nodes: int
    world_size: int | None
    restarts: int
    last_published_step: int | None
    created_at: float
    queue_position: int | None = Field(
        default=None, description="Its place in the local scheduler's queue (1: next) while QUEUED."
    )


class JobPublic(JobSummary):
    reason: str | None
    waiting: str | None = Field(
        default=None,
        description="Why it waits for free slots: to start (QUEUED), or to grow to its desired nodes.",
    )
    priority: int = Field(default=0, description="Higher starts first when jobs wait (then by submission).")
    nodes_range: str
    nproc_per_node: int
    recovery_mode: Literal["peer", "restart"] = Field(
        description="peer: survivors keep their processes and hand the state on; restart: torchrun restarts."
    )
    spares: int = Field(description="Warm spare node apps the job keeps (peer mode).")
    peer_incidents: int
    preemptions: int = Field(description="Graceful stops on request (SIGTERM); they use no restart.")
    cancel_requested: bool
    nodes: list[NodePublic]
    step: int | None
    samples_seen: int | None
    samples_per_s: float | None
    loss: float | None
    progress_at: float | None
    checkpoint_dir: str
    recoveries: list[RecoveryPublic]
    events: list[JobEvent]
    updated_at: float
    finished_at: float | None
    spec: dict[str, Any]


class JobList(BaseModel):
    jobs: list[JobSummary]
    next_cursor: str | None = Field(description="Pass as ?cursor= for the next page; null on the last.")


class CheckpointList(BaseModel):
    job: str
    checkpoints: list[CheckpointEntry] = Field(description="Published checkpoints, oldest first.")


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    ready: bool
    leader: bool = Field(description="This instance leads (runs the reconciler).")


class JobLogs(BaseModel):
    job: str
    nodes: dict[str, list[str]] = Field(description="Launch id -> its last lines, each prefixed by file.")
    note: str | None = Field(default=None, description="Nodes whose logs the service cannot read.")


class Ack(BaseModel):
    state: JobState
    cancel_requested: bool
    heartbeat_s: float = Field(
        description="How often each rank is to send its heartbeat, in seconds. The service "
        "lengthens it as the ranks it serves grow in number, up to a third of its heartbeat timeout."
    )
    progress_s: float = Field(description="How often rank 0 is to send its progress, in seconds.")


def summary(record: JobRecord) -> JobSummary:
    return JobSummary(
        id=record.id,
        name=record.name,
        state=record.state,
        desired_nodes=record.desired_nodes,
        world_size=record.world_size,
        restarts=record.restarts,
        last_published_step=record.last_published_step,
        created_at=record.created_at,
        queue_position=record.queue_position,
    )


def public(record: JobRecord, progress: Progress | None) -> JobPublic:
    """A job as GET /v1/jobs/{id} shows it: the record with its newest progress merged in, as the
    reconciler merges it at its next pass (the step, and the world size that trained it), so the
    world size after a rescale or a recovery is as fresh as the step."""
    record = merge_progress(record, progress)
    return JobPublic(
        **summary(record).model_dump(),
        reason=record.reason,
        waiting=record.waiting,
        priority=record.spec.priority if record.spec is not None else 0,
        nodes_range=f"{record.min_nodes}:{record.max_nodes}",
        nproc_per_node=record.nproc_per_node,
        recovery_mode=record.recovery_mode,
        spares=record.spares,
        peer_incidents=record.peer_incidents,
        preemptions=record.preemptions,
        cancel_requested=record.cancel_requested,
        nodes=[NodePublic.model_validate(n.model_dump()) for n in record.nodes],
        step=record.last_step,
        samples_seen=progress.samples_seen if progress else None,
        samples_per_s=progress.samples_per_s if progress else None,
        loss=progress.loss if progress else None,
        progress_at=progress.time if progress else None,
        checkpoint_dir=record.checkpoint_dir,
        recoveries=[recovery_public(r) for r in record.recoveries],
        events=list(record.events[-20:]),
        updated_at=record.updated_at,
        finished_at=record.finished_at,
        spec={} if record.spec is None else record.spec.model_dump(mode="json", by_alias=True),
    )


def recovery_public(r: Recovery) -> RecoveryPublic:
    phases = [PhasePublic(name=p.name, seconds=round(p.seconds, 6)) for p in phases_of(r)]
    return RecoveryPublic(
        **r.model_dump(exclude={"observed"}), seconds=r.seconds, steps_lost=r.steps_lost, phases=phases
    )
