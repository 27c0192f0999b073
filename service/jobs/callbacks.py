"""What a job's workers may tell the service, judged against the job's record. Pure.

A worker token is a credential job code holds, so everything it sends is checked against what
the record says the job is: the job has not ended (:func:`check_open`); a heartbeat names one of
the job's nodes and a local rank that node has (:func:`check_node`); a world size is one the
job can have (a whole number of nodes within its ``nodes`` range, times ``nproc_per_node``:
:func:`check_world_size`); a checkpoint's step lies within ``max_steps`` and at most
``STEP_WINDOW`` steps ahead of the newest progress the service has (:func:`check_step`); an
event's ranks, node index and times are ones the job can have (:func:`check_event`). Each
refusal names the field (:class:`InvalidRequestError`, 422) or says the job ended
(:class:`JobEndedError`, 409).
"""

from __future__ import annotations

from service.jobs.errors import InvalidRequestError, JobEndedError
from service.jobs.events import WorkerEvent
from service.jobs.model import JobRecord

CLOCK_SKEW_S = 300.0
"""How far a worker's clock may run ahead of the service's (its reported times are checked)."""
STEP_WINDOW = 100_000
"""How far ahead of the newest reported progress a checkpoint's step may be (progress reaches
the service every few seconds; a save is reported as it happens)."""


def check_open(record: JobRecord) -> None:
    """Raise :class:`JobEndedError` when the job has ended: its workers' callbacks, and its
    worker token, no longer work."""
    if record.state.terminal:
        raise JobEndedError(
            f"job {record.id} has ended ({record.state}); its worker callbacks and its worker token "
            "no longer work"
        )


def max_world_size(record: JobRecord) -> int:
    return record.max_nodes * record.nproc_per_node


def check_node(record: JobRecord, launch_id: str, local_rank: int) -> None:
    """A heartbeat's ``launch_id`` is one of the job's nodes; ``local_rank`` is below
    ``nproc_per_node``."""
    if launch_id not in {node.launch_id for node in record.nodes}:
        raise InvalidRequestError(
            f"{launch_id!r} is not a node of job {record.id}; send the ELASTRAIN_LAUNCH_ID the "
            "service gave this node",
            field="launch_id",
        )
    if local_rank >= record.nproc_per_node:
        raise InvalidRequestError(
            f"local rank {local_rank} is not below the job's nproc_per_node {record.nproc_per_node}",
            field="local_rank",
        )


def check_world_size(record: JobRecord, world_size: int | None, *, field: str = "world_size") -> None:
    """``world_size`` (when given) is one this job can have."""
    if world_size is None:
        return
    nproc = record.nproc_per_node
    lo, hi = record.min_nodes * nproc, max_world_size(record)
    if world_size % nproc or not lo <= world_size <= hi:
        raise InvalidRequestError(
            f"world size {world_size} is not one job {record.id} can have (a multiple of "
            f"nproc_per_node {nproc} from {lo} to {hi})",
            field=field,
        )


def check_rank(record: JobRecord, rank: int | None, *, field: str = "rank") -> None:
    if rank is not None and rank >= max_world_size(record):
        raise InvalidRequestError(
            f"rank {rank} is not below job {record.id}'s largest world size {max_world_size(record)}",
            field=field,
        )


def check_step(record: JobRecord, step: int, *, newest: int | None, field: str = "step") -> None:
    """A checkpoint's ``step`` is within the spec's ``max_steps`` and at most ``STEP_WINDOW``
    ahead of the newest progress (``newest``; None before any, as when a job starts from another
    job's checkpoint at a high step: then ``max_steps`` only)."""
    limit = record.spec.max_steps if record.spec is not None else 0
    ahead = step if newest is None else newest + STEP_WINDOW  # no progress yet: max_steps only
    if step > limit or step > ahead:
        raise InvalidRequestError(
            f"step {step} is beyond job {record.id}'s max_steps {limit} or more than "
            f"{STEP_WINDOW} steps ahead of its newest progress ({newest})",
            field=field,
        )


def check_event(record: JobRecord, event: WorkerEvent, *, now: float) -> None:
    """A worker event's world sizes, ranks and node index are ones this job can have; its times
    lie between the job's creation and now (give or take ``CLOCK_SKEW_S``)."""
    check_world_size(record, event.world_size)
    for name in ("world_before", "world_after"):
        check_world_size(record, getattr(event, name), field=name)
    check_rank(record, event.rank)
    check_rank(record, event.source_rank, field="source_rank")
    for rank in event.lost_ranks:
        check_rank(record, rank, field="lost_ranks")
    slots = record.max_nodes if event.kind == "spare_promoted" else record.max_nodes + record.spares
    if event.node_index is not None and event.node_index >= slots:
        raise InvalidRequestError(
            f"node index {event.node_index} is not below {slots} (the job's largest node count"
            f"{'' if event.kind == 'spare_promoted' else ' and its spares'})",
            field="node_index",
        )
    for name in ("failed_at", "detected_at", "formed_at", "transferred_at", "first_step_at"):
        at = getattr(event, name)
        if at is not None and not record.created_at - CLOCK_SKEW_S <= at <= now + CLOCK_SKEW_S:
            raise InvalidRequestError(
                f"{name} {at} is not a time of this job (created at {record.created_at:.3f}, now "
                f"{now:.3f}); send Unix seconds from the worker's clock",
                field=name,
            )
