"""The job state machine, pure: (record, observation or request) -> (new record, actions).

PENDING [-> QUEUED] -> LAUNCHING -> RUNNING <-> RECOVERING / RESCALING -> SUCCEEDED | FAILED | CANCELLED.
Nothing here does I/O or reads a clock; the reconciler and the API apply the results with
compare-and-set writes. Launches and cancels are returned as :class:`Launch` / :class:`Cancel`
values after the record already holds their intent (a node in ``launching`` or ``stopping``),
so a crash between writing and acting is repaired by the next decision, never doubled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from service.jobs import incidents
from service.jobs.incidents import Loss
from service.jobs.model import JobRecord, JobState, NodePhase, NodeRecord, NodeStatus, Recovery
from service.jobs.queue import Grant
from service.jobs.slots import Action, Cancel, Launch, end, match_desired, prune, stop_all
from worker.errors import ElastrainError

__all__ = ["Action", "Cancel", "Launch"]

S = JobState
ALLOWED: Mapping[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.QUEUED, S.LAUNCHING, S.FAILED, S.CANCELLED}),
    S.QUEUED: frozenset({S.LAUNCHING, S.FAILED, S.CANCELLED}),
    S.LAUNCHING: frozenset({S.RUNNING, S.RECOVERING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.RUNNING: frozenset({S.RECOVERING, S.RESCALING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.RECOVERING: frozenset({S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.RESCALING: frozenset({S.RUNNING, S.RECOVERING, S.SUCCEEDED, S.FAILED, S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


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

    @property
    def merge_window_s(self) -> float:
        """How long after an incident's first step a late observation of it still joins it."""
        return 2 * self.heartbeat_timeout_s


@dataclass(frozen=True, slots=True)
class Observation:
    now: float
    statuses: Mapping[str, NodeStatus] = field(default_factory=dict)
    """Scheduler status by launch id, for nodes that have a handle."""
    last_seen: Mapping[str, float] = field(default_factory=dict)
    """By launch id: the oldest of its ranks' newest heartbeat times."""
    last_heard: Mapping[str, float] = field(default_factory=dict)
    """By launch id: the newest heartbeat of any of its ranks (a node's last sign of life)."""
    progress_at: float | None = None
    """When the job's newest progress report came (the group's last sign of life)."""
    grant: Grant | None = None
    """The local scheduler's queue: how many nodes the job may have active now
    (:func:`service.jobs.queue.place`); None: no limit (the cluster's scheduler decides)."""
    led_since: float | None = None
    """When this leader took over: a node that beat before counts as seen then at the latest, so a
    new leader declares no node silent for beats that went to its predecessor and were not yet
    stored, or to no leader during the change (one heartbeat timeout of grace)."""


@dataclass(frozen=True, slots=True)
class Decision:
    job: JobRecord
    actions: tuple[Action, ...] = ()
    completed: tuple[Recovery, ...] = ()
    """Recoveries that completed since the metrics last took them (observe them once written)."""


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
    update = {"desired_nodes": nodes, "desired_epoch": job.desired_epoch + 1, "updated_at": now}
    scaled = job.model_copy(update=update)
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
    job, actions = _reconcile(job, obs, policy)
    job, completed = incidents.completed(prune(job))
    return Decision(job, tuple(actions), tuple(completed))


def _reconcile(job: JobRecord, obs: Observation, policy: Policy) -> tuple[JobRecord, list[Action]]:
    job, losses, actions = _observe(job, obs, policy)
    if job.state.terminal:
        return job, actions
    if job.cancel_requested:
        job, stops = stop_all(job, obs.now)
        return move(job, S.CANCELLED, obs.now, reason="cancelled on request"), [*actions, *stops]
    if any(n.phase == NodePhase.SUCCEEDED and n.role == "member" for n in job.nodes):
        job, stops = stop_all(job, obs.now, role="spare")  # the run is over: no spare is needed
        if not job.members:
            job = move(job, S.SUCCEEDED, obs.now)
        return job, [*actions, *stops]
    if losses:
        job, more = _on_failure(job, losses, obs.now, window_s=policy.merge_window_s)
        actions.extend(more)
        if job.state.terminal:
            return job, actions
    lost = {loss.node.launch_id for loss in losses}
    actions.extend(Launch(n) for n in job.nodes if n.phase == NodePhase.LAUNCHING and n.launch_id not in lost)
    job = _wait(job, obs.grant, obs.now)
    if job.state == S.QUEUED and obs.grant is not None and obs.grant.members == 0:
        return job, actions
    before = job
    cap = (None, None) if obs.grant is None else (obs.grant.members, obs.grant.spares)
    job, changes, members_changed = match_desired(job, obs.now, members_cap=cap[0], spares_cap=cap[1])
    actions.extend(changes)
    target = job.desired_nodes if cap[0] is None else min(job.desired_nodes, cap[0])
    return _advance(job, before, changed=members_changed, now=obs.now, target=target), actions


def _wait(job: JobRecord, grant: Grant | None, now: float) -> JobRecord:
    """Follow the queue's grant: a job not yet started that may start no node waits in QUEUED
    (its place and why kept on the record); any job keeps the grant's words on why it waits."""
    if grant is None:
        return job
    if job.state in (S.PENDING, S.QUEUED) and grant.members == 0:
        job = move(job, S.QUEUED, now, reason=grant.waiting)
    if job.queue_position == grant.position and job.waiting == grant.waiting:
        return job
    update: dict[str, object] = {"queue_position": grant.position, "waiting": grant.waiting}
    if job.state == S.QUEUED:
        update["reason"] = grant.waiting
    return job.model_copy(update=update)


def _observe(job: JobRecord, obs: Observation, policy: Policy) -> tuple[JobRecord, list[Loss], list[Action]]:
    """Fold scheduler statuses and heartbeats into the nodes; return the newly lost ones."""
    nodes, losses, actions = list(job.nodes), list[Loss](), list[Action]()
    for i, node in enumerate(nodes):
        status = obs.statuses.get(node.launch_id)
        state = status.state if status is not None else "unknown"
        if node.phase == NodePhase.STOPPING:
            if state == "running":
                actions.append(Cancel(node))
            else:
                nodes[i] = end(node, NodePhase.STOPPED, obs.now)
            continue
        if node.phase != NodePhase.RUNNING:
            continue
        if state == "succeeded":
            nodes[i] = end(node, NodePhase.SUCCEEDED, obs.now, exit_code=0)
        elif state == "failed":
            code = status.exit_code if status is not None else None
            nodes[i] = end(node, NodePhase.FAILED, obs.now, exit_code=code)
            losses.append(Loss(nodes[i], last_sign_of_life(job, node, obs)))
        elif _silent(job, node, obs, policy, scheduler_says_running=state == "running"):
            nodes[i] = end(node, NodePhase.LOST, obs.now)
            losses.append(Loss(nodes[i], last_sign_of_life(job, node, obs)))
            actions.append(Cancel(node))
    return job.model_copy(update={"nodes": tuple(nodes)}), losses, actions


def last_sign_of_life(job: JobRecord, node: NodeRecord, obs: Observation) -> float:
    """When ``node`` was last known alive: the end of its agent where the scheduler recorded it;
    else its newest heartbeat, or (restart mode, a member of a training group: every step needs
    every rank) the group's newest progress, whichever is later; never after now."""
    status = obs.statuses.get(node.launch_id)
    if status is not None and status.ended_at is not None:
        return min(status.ended_at, obs.now)
    signs = [obs.last_heard.get(node.launch_id), obs.last_seen.get(node.launch_id), node.launched_at]
    if job.recovery_mode == "restart" and node.role == "member" and job.state == S.RUNNING:
        signs.append(obs.progress_at)
    known = [t for t in signs if t is not None]
    return min(max(known), obs.now) if known else obs.now


def _silent(
    job: JobRecord, node: NodeRecord, obs: Observation, policy: Policy, *, scheduler_says_running: bool
) -> bool:
    """Lost: heartbeats stopped (a hung worker), or unknown to the scheduler and never heard of.
    A node the scheduler runs that never sent a heartbeat is trusted to the scheduler."""
    seen = obs.last_seen.get(node.launch_id)
    if job.state.terminal or (seen is None and scheduler_says_running):
        return False
    baseline = max(seen or 0.0, node.launched_at or 0.0, job.state_since)
    if seen is not None and obs.led_since is not None:
        baseline = max(baseline, obs.led_since)
    running = job.state == S.RUNNING and seen is not None
    limit = policy.heartbeat_timeout_s if running else policy.startup_timeout_s
    return obs.now - baseline > limit


def _name(node: NodeRecord) -> str:
    return f"{'spare' if node.role == 'spare' else 'node'} {node.index} ({node.launch_id})"


def _describe_failure(node: NodeRecord) -> str:
    what = _name(node)
    if node.phase == NodePhase.LOST:
        return f"{what} was lost: no heartbeat and no running app"
    if node.exit_code is None:
        return f"{what} failed"
    return f"{what} failed with exit code {node.exit_code}"


def _on_failure(
    job: JobRecord, losses: Sequence[Loss], now: float, *, window_s: float, why: str | None = None
) -> tuple[JobRecord, list[Action]]:
    """Lost nodes join the incident they belong to or open one (:mod:`service.jobs.incidents`);
    a lost spare that no incident lost is replaced. A restart-mode incident, and a replacement
    that failed, use a restart: beyond ``max_restarts`` the job fails."""
    for loss in losses:
        job = job.with_event(now, "node_failed", why or _describe_failure(loss.node))
    folded = incidents.fold_losses(job, losses, now=now, window_s=window_s)
    job = folded.job
    spares = [loss for loss in folded.fresh if loss.node.role == "spare"]
    fresh = [loss for loss in folded.fresh if loss.node.role == "member"]
    if spares:
        job = job.model_copy(update={"spare_failures": job.spare_failures + len(spares)})
    preemption = job.preempted_step is not None  # the workers stopped on request and saved
    charge = folded.replacements + (1 if fresh and job.recovery_mode == "restart" and not preemption else 0)
    if not fresh and not charge:
        return job, []
    reason = why or "; ".join(_describe_failure(loss.node) for loss in fresh or losses)
    if charge and job.restarts + charge > job.max_restarts:
        job, stops = stop_all(job, now)
        why = f"{reason}; all {job.max_restarts} restarts are used (raise 'max_restarts' to allow more)"
        return move(job, S.FAILED, now, reason=why), stops
    job = job.model_copy(update={"restarts": job.restarts + charge})
    if fresh:
        charged = job.recovery_mode == "restart" and not preemption
        job = incidents.open_for_losses(job, fresh, now=now, reason=reason, charged=charged)
        if job.state in (S.RUNNING, S.RESCALING, S.LAUNCHING):
            job = move(job, S.RECOVERING, now, reason=reason)
    return job, []


def _advance(job: JobRecord, before: JobRecord, *, changed: bool, now: float, target: int) -> JobRecord:
    """``target``: the members the job may have now (its desired size, or less while it waits
    for slots to grow)."""
    if job.state in (S.PENDING, S.QUEUED) and job.nodes:
        return move(job, S.LAUNCHING, now)
    members = job.members
    all_up = bool(members) and all(n.phase == NodePhase.RUNNING for n in members)
    if job.state == S.LAUNCHING and all_up and len(members) == target:
        return move(job, S.RUNNING, now)
    if job.state == S.RUNNING and changed and before.members:
        return move(job, S.RESCALING, now, reason=f"to {len(members)} nodes")
    return job


def fail(job: JobRecord, now: float, *, reason: str) -> JobRecord:
    """Fail the job now, without another restart: every running node is marked ``stopping`` (the
    next :func:`reconcile` cancels it), every launch intent is dropped. A finished job is
    returned as is."""
    if job.state.terminal:
        return job
    job, _ = stop_all(job, now)
    return move(job, S.FAILED, now, reason=reason)


def launch_failed(
    job: JobRecord,
    node_launch_id: str,
    message: str,
    now: float,
    *,
    window_s: float = Policy().merge_window_s,
) -> JobRecord:
    """The scheduler refused to launch a node: it counts as a failed node (restart or FAILED)."""
    nodes = list(job.nodes)
    for i, node in enumerate(nodes):
        if node.launch_id == node_launch_id and node.phase == NodePhase.LAUNCHING:
            if job.state.terminal:
                return job
            nodes[i] = end(node, NodePhase.FAILED, now)
            job = job.model_copy(update={"nodes": tuple(nodes)})
            why = f"{_name(node)} could not be launched: {message}"
            return _on_failure(job, [Loss(nodes[i], now)], now, window_s=window_s, why=why)[0]
    return job
