"""The job state machine, pure: (record, observation or request) -> (new record, actions).

PENDING -> LAUNCHING -> RUNNING <-> RECOVERING / RESCALING -> SUCCEEDED | FAILED | CANCELLED.
Nothing here does I/O or reads a clock; the reconciler and the API apply the results with
compare-and-set writes. Launches and cancels are returned as :class:`Launch` / :class:`Cancel`
values after the record already holds their intent (a node in ``launching`` or ``stopping``),
so a crash between writing and acting is repaired by the next decision, never doubled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from service.jobs.model import (
    MAX_RECOVERIES,
    JobRecord,
    JobState,
    NodePhase,
    NodeRecord,
    NodeStatus,
    Recovery,
    launch_id,
)
from worker.errors import ElastrainError

S = JobState
ALLOWED: Mapping[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.LAUNCHING, S.FAILED, S.CANCELLED}),
    S.LAUNCHING: frozenset({S.RUNNING, S.RECOVERING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.RECOVERING, S.RESCALING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.RECOVERING: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.RESCALING: frozenset({S.RUNNING, S.RECOVERING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}
MAX_ENDED_NODES = 16


class IllegalTransitionError(ElastrainError):
    """A request the job's current state does not allow; ``code`` names the rule."""

    def __init__(self, message: str, *, code: str = "illegal_transition") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Policy:
    heartbeat_timeout_s: float = 60.0
    """A node of a RUNNING job whose slowest rank has not sent a heartbeat for this long is lost."""
    startup_timeout_s: float = 300.0
    """Outside RUNNING (launching, re-forming) a node may stay silent this long."""


@dataclass(frozen=True, slots=True)
class Observation:
    now: float
    statuses: Mapping[str, NodeStatus] = field(default_factory=dict)
    """Scheduler status by launch id, for nodes that have a handle."""
    last_seen: Mapping[str, float] = field(default_factory=dict)
    """By launch id: the oldest of its ranks' newest heartbeat times."""


@dataclass(frozen=True, slots=True)
class Launch:
    node: NodeRecord


@dataclass(frozen=True, slots=True)
class Cancel:
    node: NodeRecord


Action = Launch | Cancel


@dataclass(frozen=True, slots=True)
class Decision:
    job: JobRecord
    actions: tuple[Action, ...] = ()


def move(job: JobRecord, state: JobState, now: float, *, reason: str | None = None) -> JobRecord:
    """Change state along an allowed edge (raises :class:`IllegalTransitionError` otherwise).
    ``reason`` explains the new state; a state without one clears the old reason."""
    if state == job.state:
        return job
    if state not in ALLOWED[job.state]:
        raise IllegalTransitionError(f"job {job.id} cannot go from {job.state} to {state}")
    update: dict[str, object] = {"state": state, "state_since": now, "updated_at": now, "reason": reason}
    if state.terminal:
        update["finished_at"] = now
    moved = job.model_copy(update=update)
    return moved.with_event(now, "state", f"{job.state} -> {state}" + (f": {reason}" if reason else ""))


def request_scale(job: JobRecord, nodes: int, now: float) -> JobRecord:
    """Set the desired node count. Raises for a finished job or a count outside min:max."""
    if job.state.terminal or job.cancel_requested:
        raise IllegalTransitionError(
            f"job {job.id} is {job.state}{' (cancelling)' if job.cancel_requested else ''}; "
            "only a live job can be scaled",
            code="job_finished",
        )
    if not job.min_nodes <= nodes <= job.max_nodes:
        raise IllegalTransitionError(
            f"nodes must be within the job's range {job.min_nodes}:{job.max_nodes}, got {nodes}; "
            "submit the job with a wider 'nodes' range to go further",
            code="out_of_range",
        )
    if nodes == job.desired_nodes:
        return job
    scaled = job.model_copy(update={"desired_nodes": nodes, "updated_at": now})
    return scaled.with_event(now, "scale", f"desired nodes {job.desired_nodes} -> {nodes}")


def request_cancel(job: JobRecord, now: float) -> JobRecord:
    """Ask for cancellation. Idempotent: a finished or already cancelling job is returned as is."""
    if job.state.terminal or job.cancel_requested:
        return job
    return job.model_copy(update={"cancel_requested": True}).with_event(now, "cancel", "cancel requested")


def confirm_launch(job: JobRecord, node_launch_id: str, handle: str, now: float) -> tuple[JobRecord, bool]:
    """Record the handle of a launched node. The flag is False when that node is no longer
    wanted (stopped meanwhile): the caller must cancel ``handle``."""
    nodes = list(job.nodes)
    for i, node in enumerate(nodes):
        if node.launch_id == node_launch_id and node.phase == NodePhase.LAUNCHING:
            up = {"phase": NodePhase.RUNNING, "handle": handle, "launched_at": now}
            nodes[i] = node.model_copy(update=up)
            updated = job.model_copy(update={"nodes": tuple(nodes)})
            return updated.with_event(now, "node", f"node {node.index} launched as {handle}"), True
        if node.launch_id == node_launch_id and node.handle == handle:
            return job, True
    return job, False


def reconcile(job: JobRecord, obs: Observation, policy: Policy = Policy()) -> Decision:
    """One step of the leader's loop for one job."""
    job, failed, actions = _observe(job, obs, policy)
    if job.state.terminal:
        return Decision(_prune(job), tuple(actions))
    if job.cancel_requested:
        job, stops = _stop_all(job, obs.now)
        job = move(job, S.CANCELLED, obs.now, reason="cancelled on request")
        return Decision(_prune(job), (*actions, *stops))
    if any(n.phase == NodePhase.SUCCEEDED for n in job.nodes):
        if not job.active_nodes:
            job = move(job, S.SUCCEEDED, obs.now)
        return Decision(_prune(job), tuple(actions))
    if failed:
        job, more = _on_failure(job, failed, obs.now)
        actions.extend(more)
        if job.state.terminal:
            return Decision(_prune(job), tuple(actions))
    actions.extend(Launch(n) for n in job.nodes if n.phase == NodePhase.LAUNCHING and n not in failed)
    before = job
    job, changes = _match_desired(job, obs.now)
    actions.extend(changes)
    job = _advance(job, before, changed=bool(changes), now=obs.now)
    return Decision(_prune(job), tuple(actions))


def _observe(
    job: JobRecord, obs: Observation, policy: Policy
) -> tuple[JobRecord, list[NodeRecord], list[Action]]:
    """Fold scheduler statuses and heartbeats into the nodes; return newly failed nodes."""
    nodes, failed, actions = list(job.nodes), [], list[Action]()
    for i, node in enumerate(nodes):
        status = obs.statuses.get(node.launch_id)
        state = status.state if status is not None else "unknown"
        if node.phase == NodePhase.STOPPING:
            if state == "running":
                actions.append(Cancel(node))
            else:
                nodes[i] = _end(node, NodePhase.STOPPED, obs.now)
            continue
        if node.phase != NodePhase.RUNNING:
            continue
        if state == "succeeded":
            nodes[i] = _end(node, NodePhase.SUCCEEDED, obs.now, exit_code=0)
        elif state == "failed":
            code = status.exit_code if status is not None else None
            nodes[i] = _end(node, NodePhase.FAILED, obs.now, exit_code=code)
            failed.append(nodes[i])
        elif _silent(job, node, obs, policy, scheduler_says_running=state == "running"):
            nodes[i] = _end(node, NodePhase.LOST, obs.now)
            failed.append(nodes[i])
            actions.append(Cancel(node))
    return job.model_copy(update={"nodes": tuple(nodes)}), failed, actions


def _end(node: NodeRecord, phase: NodePhase, now: float, *, exit_code: int | None = None) -> NodeRecord:
    update: dict[str, object] = {"phase": phase, "ended_at": now}
    if exit_code is not None:
        update["exit_code"] = exit_code
    return node.model_copy(update=update)


def _silent(
    job: JobRecord, node: NodeRecord, obs: Observation, policy: Policy, *, scheduler_says_running: bool
) -> bool:
    """Lost: heartbeats stopped (a hung worker), or unknown to the scheduler and never heard of.
    A node the scheduler runs that never sent a heartbeat is trusted to the scheduler."""
    seen = obs.last_seen.get(node.launch_id)
    if job.state.terminal or (seen is None and scheduler_says_running):
        return False
    baseline = max(seen or 0.0, node.launched_at or 0.0, job.state_since)
    running = job.state == S.RUNNING and seen is not None
    limit = policy.heartbeat_timeout_s if running else policy.startup_timeout_s
    return obs.now - baseline > limit


def _describe_failure(node: NodeRecord) -> str:
    if node.phase == NodePhase.LOST:
        return f"node {node.index} ({node.launch_id}) was lost: no heartbeat and no running app"
    if node.exit_code is None:
        return f"node {node.index} ({node.launch_id}) failed"
    return f"node {node.index} ({node.launch_id}) failed with exit code {node.exit_code}"


def _on_failure(
    job: JobRecord, failed: Sequence[NodeRecord], now: float, *, why: str | None = None
) -> tuple[JobRecord, list[Action]]:
    reason = why or "; ".join(_describe_failure(n) for n in failed)
    for node in failed:
        job = job.with_event(now, "node_failed", why or _describe_failure(node))
    if job.restarts >= job.max_restarts:
        job, stops = _stop_all(job, now)
        why = f"{reason}; all {job.max_restarts} restarts are used (raise 'max_restarts' to allow more)"
        return move(job, S.FAILED, now, reason=why), stops
    recovery = Recovery(reason=reason, failed_at=now, step_before=job.last_step)
    recoveries = (*job.recoveries, recovery)[-MAX_RECOVERIES:]
    job = job.model_copy(update={"restarts": job.restarts + 1, "recoveries": recoveries})
    if job.state in (S.RUNNING, S.RESCALING, S.LAUNCHING):
        job = move(job, S.RECOVERING, now, reason=reason)
    return job, []


def _stop_all(job: JobRecord, now: float) -> tuple[JobRecord, list[Action]]:
    nodes, actions = list(job.nodes), list[Action]()
    for i, node in enumerate(nodes):
        if node.phase == NodePhase.RUNNING:
            nodes[i] = node.model_copy(update={"phase": NodePhase.STOPPING})
            actions.append(Cancel(nodes[i]))
        elif node.phase == NodePhase.LAUNCHING:
            nodes[i] = _end(node, NodePhase.STOPPED, now)
    return job.model_copy(update={"nodes": tuple(nodes)}), actions


def _match_desired(job: JobRecord, now: float) -> tuple[JobRecord, list[Action]]:
    """Launch into free slots or stop the highest slots until active nodes == desired."""
    nodes, actions = list(job.nodes), list[Action]()
    active = [n for n in nodes if n.phase.active]
    busy = {n.index for n in nodes if n.phase.active or n.phase == NodePhase.STOPPING}
    attempts = dict(job.next_attempt)  # never pruned, so a launch id is never reused
    for _ in range(job.desired_nodes - len(active)):
        index = next(i for i in range(len(busy) + 1) if i not in busy)
        attempt = max(
            attempts.get(index, 0), 1 + max((n.attempt for n in nodes if n.index == index), default=-1)
        )
        attempts[index] = attempt + 1
        new = NodeRecord(index=index, attempt=attempt, launch_id=launch_id(job.id, index, attempt))
        nodes.append(new)
        busy.add(index)
        actions.append(Launch(new))
    surplus = max(0, len(active) - job.desired_nodes)
    for node in sorted(active, key=lambda n: n.index, reverse=True)[:surplus]:
        i = nodes.index(node)
        if node.phase == NodePhase.RUNNING:
            nodes[i] = node.model_copy(update={"phase": NodePhase.STOPPING})
            actions.append(Cancel(nodes[i]))
        else:
            nodes[i] = _end(node, NodePhase.STOPPED, now)
    return job.model_copy(update={"nodes": tuple(nodes), "next_attempt": attempts}), actions


def _advance(job: JobRecord, before: JobRecord, *, changed: bool, now: float) -> JobRecord:
    if job.state == S.PENDING and job.nodes:
        return move(job, S.LAUNCHING, now)
    all_up = bool(job.active_nodes) and all(n.phase == NodePhase.RUNNING for n in job.active_nodes)
    if job.state == S.LAUNCHING and all_up and len(job.active_nodes) == job.desired_nodes:
        return move(job, S.RUNNING, now)
    if job.state == S.RUNNING and changed and before.active_nodes:
        return move(job, S.RESCALING, now, reason=f"to {job.desired_nodes} nodes")
    return job


def _prune(job: JobRecord) -> JobRecord:
    ended = [n for n in job.nodes if n.phase.ended]
    if len(ended) <= MAX_ENDED_NODES:
        return job
    drop = {id(n) for n in ended[: len(ended) - MAX_ENDED_NODES]}
    return job.model_copy(update={"nodes": tuple(n for n in job.nodes if id(n) not in drop)})


def fail(job: JobRecord, now: float, *, reason: str) -> JobRecord:
    """Fail the job now, without another restart: every running node is marked ``stopping`` (the
    next :func:`reconcile` cancels it), every launch intent is dropped. A finished job is
    returned as is."""
    if job.state.terminal:
        return job
    job, _ = _stop_all(job, now)
    return move(job, S.FAILED, now, reason=reason)


def launch_failed(job: JobRecord, node_launch_id: str, message: str, now: float) -> JobRecord:
    """The scheduler refused to launch a node: it counts as a failed node (restart or FAILED)."""
    nodes = list(job.nodes)
    for i, node in enumerate(nodes):
        if node.launch_id == node_launch_id and node.phase == NodePhase.LAUNCHING:
            if job.state.terminal:
                return job
            nodes[i] = _end(node, NodePhase.FAILED, now)
            job = job.model_copy(update={"nodes": tuple(nodes)})
            why = f"node {node.index} ({node.launch_id}) could not be launched: {message}"
            return _on_failure(job, [nodes[i]], now, why=why)[0]
    return job
