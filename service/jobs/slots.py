"""The node apps of a job: members in slots, warm spares beside them, and the actions that keep
their counts where the record wants them. Pure.

A member's ``index`` is its slot (``0 .. desired - 1`` as the job scales); the k-th spare place is
``max_nodes + k``, so every launch id (``<job>-n<index>-a<attempt>``, attempts never reused per
index) names one launch for good. Spares are kept only in peer mode (``JobRecord.spares``).

When the workers' group gives a lost member's slot to a spare (the ``spare_promoted`` report),
:func:`promote` relabels the spare as the member of that slot. The node that held the slot, if it
still runs (its agent restarted its workers, which came back as newcomers and wait as spares),
takes the spare's place; if it ended, the spare place is free and :func:`match_desired` launches
a new spare. A member whose slot no spare took is replaced by a new member in the same slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.jobs.model import JobRecord, NodePhase, NodeRecord, NodeRole, launch_id


@dataclass(frozen=True, slots=True)
class Launch:
    node: NodeRecord


@dataclass(frozen=True, slots=True)
class Cancel:
    node: NodeRecord


Action = Launch | Cancel
MAX_ENDED_NODES = 16


def spare_failure_limit(job: JobRecord) -> int:
    """Spare launches that may fail before the job stops keeping spares (a spare that cannot
    start would otherwise be launched again every pass)."""
    return 3 + 2 * job.spares


def wanted_spares(job: JobRecord) -> int:
    """Spares to keep now: the record's count in peer mode, while the job trains and spare
    failures stay within :func:`spare_failure_limit`."""
    if job.recovery_mode != "peer" or job.state.terminal or job.cancel_requested:
        return 0
    if job.spare_failures >= spare_failure_limit(job):
        return 0
    return job.spares


def end(node: NodeRecord, phase: NodePhase, now: float, *, exit_code: int | None = None) -> NodeRecord:
    update: dict[str, object] = {"phase": phase, "ended_at": now}
    if exit_code is not None:
        update["exit_code"] = exit_code
    return node.model_copy(update=update)


def stop(node: NodeRecord, now: float) -> tuple[NodeRecord, list[Action]]:
    """A running node is cancelled (``stopping``); a launch intent is dropped (``stopped``)."""
    if node.phase == NodePhase.RUNNING:
        stopping = node.model_copy(update={"phase": NodePhase.STOPPING})
        return stopping, [Cancel(stopping)]
    if node.phase == NodePhase.LAUNCHING:
        return end(node, NodePhase.STOPPED, now), []
    return node, []


def stop_all(job: JobRecord, now: float, *, role: NodeRole | None = None) -> tuple[JobRecord, list[Action]]:
    """Stop every node (of ``role``, when given)."""
    nodes, actions = list(job.nodes), list[Action]()
    for i, node in enumerate(nodes):
        if role is None or node.role == role:
            nodes[i], more = stop(node, now)
            actions += more
    return job.model_copy(update={"nodes": tuple(nodes)}), actions


def match_desired(
    job: JobRecord, now: float, *, members_cap: int | None = None, spares_cap: int | None = None
) -> tuple[JobRecord, list[Action], bool]:
    """Launch into free slots or stop the highest slots until active members == desired, and the
    same for spares; the flag says whether the members changed. A cap (the local scheduler's
    grant) holds launches back, never stops what runs."""
    nodes, attempts = list(job.nodes), dict(job.next_attempt)  # never pruned: no id is reused
    want = _capped(job.desired_nodes, len(job.members), members_cap)
    actions = _match(nodes, attempts, job, role="member", want=want, now=now)
    changed = bool(actions)
    spares = sum(1 for n in job.nodes if n.phase.active and n.role == "spare")
    want_spares = _capped(wanted_spares(job), spares, spares_cap)
    actions += _match(nodes, attempts, job, role="spare", want=want_spares, now=now)
    return job.model_copy(update={"nodes": tuple(nodes), "next_attempt": attempts}), actions, changed


def _capped(want: int, active: int, cap: int | None) -> int:
    """``want``, launching no more than ``cap`` allows (what is active is kept)."""
    return want if cap is None or want <= active else min(want, max(cap, active))


def _match(
    nodes: list[NodeRecord],
    attempts: dict[int, int],
    job: JobRecord,
    *,
    role: NodeRole,
    want: int,
    now: float,
) -> list[Action]:
    actions: list[Action] = []
    mine = [n for n in nodes if n.role == role]
    active = [n for n in mine if n.phase.active]
    busy = {n.index for n in mine if n.phase.active or n.phase == NodePhase.STOPPING}
    base = 0 if role == "member" else job.max_nodes
    for _ in range(want - len(active)):
        index = next(i for i in range(base, base + len(busy) + 1) if i not in busy)
        attempt = max(
            attempts.get(index, 0), 1 + max((n.attempt for n in nodes if n.index == index), default=-1)
        )
        attempts[index] = attempt + 1
        new = NodeRecord(index=index, attempt=attempt, role=role, launch_id=launch_id(job.id, index, attempt))
        nodes.append(new)
        busy.add(index)
        actions.append(Launch(new))
    surplus = max(0, len(active) - want)
    for node in sorted(active, key=lambda n: n.index, reverse=True)[:surplus]:
        i = nodes.index(node)
        nodes[i], more = stop(node, now)
        actions += more
    return actions


def promote(job: JobRecord, spare_launch_id: str, slot: int, now: float) -> JobRecord:
    """The workers gave ``slot`` to the spare ``spare_launch_id``: relabel it as that slot's
    member; the node that held the slot, if still active, takes the spare's place. Idempotent."""
    nodes = list(job.nodes)
    at = next((i for i, n in enumerate(nodes) if n.launch_id == spare_launch_id), None)
    if at is None or not nodes[at].phase.active:
        return job.with_event(now, "spare", f"{spare_launch_id} was reported promoted but is not a live node")
    spare = nodes[at]
    if spare.role == "member" and spare.index == slot:
        return job  # told before
    if spare.role != "spare":
        return job.with_event(now, "spare", f"{spare_launch_id} was reported promoted but is a member")
    nodes[at] = spare.model_copy(update={"role": "member", "index": slot})
    message = f"spare {spare_launch_id} took slot {slot}"
    for i, node in enumerate(nodes):
        if i != at and node.role == "member" and node.index == slot and node.phase.active:
            nodes[i] = node.model_copy(update={"role": "spare", "index": spare.index})
            message += f"; {node.launch_id}, which held it, is a spare now"
            break
    else:
        message += "; a new spare will be launched"
    return job.model_copy(update={"nodes": tuple(nodes)}).with_event(now, "spare", message)


def prune(job: JobRecord) -> JobRecord:
    ended = [n for n in job.nodes if n.phase.ended]
    if len(ended) <= MAX_ENDED_NODES:
        return job
    drop = {id(n) for n in ended[: len(ended) - MAX_ENDED_NODES]}
    return job.model_copy(update={"nodes": tuple(n for n in job.nodes if id(n) not in drop)})


def gang(job: JobRecord, actions: Sequence[Action]) -> list[NodeRecord]:
    """The launches of ``actions`` that start ``job``'s minimum together (one Volcano gang on
    Kubernetes): its first ``min_nodes`` members, when a restart-mode job of at least two minimum
    nodes has none running and this pass launches that many. Empty otherwise: a node that joins
    a running group, a spare and a peer-mode member launch alone (peers are replaced one at a
    time while the others train, which a gang's shared fate would undo). Pure."""
    if job.recovery_mode != "restart" or job.min_nodes < 2:
        return []
    if any(n.phase in (NodePhase.RUNNING, NodePhase.STOPPING) for n in job.nodes):
        return []
    members = sorted(
        (a.node for a in actions if isinstance(a, Launch) and a.node.role == "member"), key=lambda n: n.index
    )
    return members[: job.min_nodes] if len(members) >= job.min_nodes else []
