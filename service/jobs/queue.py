"""The local scheduler's queue: which jobs start and which grow, from the jobs and the free slots.
Pure: plain values in, a :class:`Grant` per job out; the reconciler applies it.

A slot is one worker process. A node app of ``nproc_per_node`` processes takes that many slots,
a warm spare's too, and a node being stopped holds its slots until it is gone. Nothing running is
ever stopped to make room: a job keeps what it holds.

The policy, in order:

1. A started job first gets back to its minimum size (a lost member's replacement).
2. Jobs that wait (``PENDING`` or ``QUEUED``) start by ``priority`` (higher first), then by
   submission, each only when its minimum size fits (gang: ``min nodes x nproc_per_node`` slots,
   never a part of it). A job that does not fit does not block a smaller one behind it that does
   (backfill), so slots are not left idle while the head waits.
3. Backfill has a limit, so that a stream of small jobs cannot starve a big one: once the first
   job that does not fit has waited :data:`BACKFILL_FOR_S`, nothing behind it starts until it has;
   the slots that free up collect for it.
4. Only when no job waits do started jobs grow toward their desired size and get their warm
   spares, by the same order. While a job waits, no running job takes the slots it waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from service.jobs.model import JobRecord, JobState, NodePhase
from service.jobs.slots import wanted_spares
from worker.errors import SpecError
from worker.jobspec.spec import JobSpec, parse_nodes

BACKFILL_FOR_S = 600.0
"""How long the first job that does not fit may watch smaller jobs start past it."""


@dataclass(frozen=True, slots=True)
class Demand:
    """One live job as the queue sees it."""

    job_id: str
    priority: int
    submitted_at: float
    nproc: int
    min_nodes: int
    desired_nodes: int
    spares: int = 0
    """Warm spares the job wants now."""
    members: int = 0
    """Active member node apps (launching or running)."""
    held_spares: int = 0
    started: bool = False
    """It has launched before (not PENDING or QUEUED)."""
    waiting_since: float | None = None
    """When it entered the queue (its state's start while QUEUED)."""
    stopping: int = 0
    """Node apps being stopped: they hold their slots until they are gone."""

    @property
    def held(self) -> int:
        return (self.members + self.held_spares + self.stopping) * self.nproc


@dataclass(frozen=True, slots=True)
class Grant:
    """What a job may have active: ``members`` member nodes and ``spares`` spares. ``position``:
    its place in the queue (1: next), None when it is not waiting to start; ``waiting``: why it
    waits (to start, or to grow), in words a user can act on."""

    members: int
    spares: int
    position: int | None = None
    waiting: str | None = None


def order(demands: Iterable[Demand]) -> list[Demand]:
    """Priority first (higher first), then submission (older first); the id breaks ties."""
    return sorted(demands, key=lambda d: (-d.priority, d.submitted_at, d.job_id))


def place(demands: Iterable[Demand], *, slots: int, now: float) -> dict[str, Grant]:
    """Each live job's grant (see the module's policy). Pure."""
    jobs = order(demands)
    free = slots - sum(d.held for d in jobs)
    members = {d.job_id: d.members for d in jobs}
    for d in jobs:  # 1. back to the minimum
        if d.started and d.members < d.min_nodes:
            take = max(0, min(d.min_nodes - d.members, free // d.nproc))
            members[d.job_id] += take
            free -= take * d.nproc
    waiting: dict[str, str] = {}
    positions: dict[str, int] = {}
    head: Demand | None = None  # the first job that did not fit
    for d in (d for d in jobs if not d.started):  # 2. and 3. start by order, with backfill
        need = d.min_nodes * d.nproc
        starved = head is not None and now - (head.waiting_since or now) >= BACKFILL_FOR_S
        if need <= free and not starved:
            members[d.job_id] = d.min_nodes
            free -= need
            continue
        positions[d.job_id] = len(positions) + 1
        if starved and head is not None:
            waiting[d.job_id] = (
                f"waits behind job {head.job_id}, which has waited {BACKFILL_FOR_S:g} s for its "
                f"slots: nothing starts past it until it has started"
            )
        else:
            waiting[d.job_id] = _short(need, d, free=free, slots=slots)
        head = head or d
    spares = {d.job_id: d.held_spares for d in jobs}
    if not positions:  # 4. growth and spares, only when no job waits
        for d in jobs:
            grow = max(0, min(d.desired_nodes - members[d.job_id], free // d.nproc))
            members[d.job_id] += grow
            free -= grow * d.nproc
        for d in jobs:
            more = max(0, min(d.spares - spares[d.job_id], free // d.nproc))
            spares[d.job_id] += more
            free -= more * d.nproc
    for d in jobs:
        if d.job_id not in waiting and members[d.job_id] < d.desired_nodes:
            waiting[d.job_id] = _growth(d, members[d.job_id], free=free, slots=slots, queued=bool(positions))
    return {
        d.job_id: Grant(members[d.job_id], spares[d.job_id], positions.get(d.job_id), waiting.get(d.job_id))
        for d in jobs
    }


def _short(need: int, d: Demand, *, free: int, slots: int) -> str:
    return (
        f"waits for {need} free slots (its minimum: {d.min_nodes} node(s) x {d.nproc} process(es)); "
        f"{max(free, 0)} of {slots} are free"
    )


def _growth(d: Demand, members: int, *, free: int, slots: int, queued: bool) -> str:
    more = d.desired_nodes - members
    why = "jobs wait in the queue" if queued else f"{max(free, 0)} of {slots} slots are free"
    return (
        f"runs {members} of its {d.desired_nodes} desired nodes: {more} more need "
        f"{more * d.nproc} free slots, and {why}"
    )


def demand(job: JobRecord) -> Demand:
    """What ``job`` holds and wants. A finished or cancelling job wants nothing more and holds its
    nodes until they are stopped."""
    active = [n for n in job.nodes if n.phase.active]
    done = job.state.terminal or job.cancel_requested
    waits = job.state in (JobState.PENDING, JobState.QUEUED)
    return Demand(
        job_id=job.id,
        priority=job.spec.priority if job.spec is not None else 0,
        submitted_at=job.created_at,
        nproc=job.nproc_per_node,
        min_nodes=0 if done else job.min_nodes,
        desired_nodes=0 if done else job.desired_nodes,
        spares=wanted_spares(job),
        members=sum(1 for n in active if n.role == "member"),
        held_spares=sum(1 for n in active if n.role == "spare"),
        started=done or not waits,
        waiting_since=job.state_since if job.state == JobState.QUEUED else job.created_at,
        stopping=sum(1 for n in job.nodes if n.phase == NodePhase.STOPPING),
    )


def check(spec: JobSpec, slots: int) -> None:
    """Refuse a job whose minimum size could never fit in ``slots`` (it would wait for good).
    Raises :class:`SpecError` naming the field and the fix."""
    lo = parse_nodes(spec.nodes)[0]
    need = lo * spec.nproc_per_node
    if need > slots:
        raise SpecError(
            f"field 'nodes': the job needs at least {lo} node(s) x {spec.nproc_per_node} process(es) "
            f"= {need} worker processes at once, and this service runs at most {slots} "
            "(ELASTRAIN_LOCAL_SLOTS); give a smaller minimum in 'nodes' or 'nproc_per_node', or "
            "ask the operator for more slots"
        )


def grant_all(records: Sequence[JobRecord], *, slots: int, now: float) -> dict[str, Grant]:
    """:func:`place` over the jobs that hold or want slots: every live job, and a finished one
    until its nodes are stopped."""
    holding = (NodePhase.LAUNCHING, NodePhase.RUNNING, NodePhase.STOPPING)
    live = [r for r in records if not r.state.terminal or any(n.phase in holding for n in r.nodes)]
    return place([demand(r) for r in live], slots=slots, now=now)


def still_waiting(job: JobRecord, grant: Grant | None) -> bool:
    """A QUEUED job whose grant starts nothing and says what its record says: nothing to decide
    or write, so a pass skips it (a queued job costs a pass no more than its listing)."""
    return (
        grant is not None
        and job.state == JobState.QUEUED
        and not job.cancel_requested
        and grant.members == 0
        and (job.queue_position, job.waiting) == (grant.position, grant.waiting)
    )
