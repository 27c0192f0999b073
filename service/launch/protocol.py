"""What the reconciler needs from a scheduler: launch a node, ask about it, cancel it, say
where its logs are, and close. :class:`service.launch.torchx_scheduler.TorchXScheduler`
implements it; tests implement it with fakes (in memory, or files a test process writes)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from service.jobs.errors import InvalidRequestError
from service.jobs.model import JobRecord, NodeRecord, NodeRole, NodeState, NodeStatus, RecoveryMode
from worker.jobspec.spec import JobSpec

__all__ = ["UNKNOWN", "NodeLaunch", "NodeState", "NodeStatus", "Scheduler", "gang_launcher", "node_launch"]

UNKNOWN = NodeStatus("unknown")


@dataclass(frozen=True, slots=True)
class NodeLaunch:
    """One launch of one node slot of a job: what the reconciler asks a scheduler to start."""

    job_id: str
    spec: JobSpec
    node_index: int
    launch_id: str
    """Unique to this launch of this slot; a scheduler launches each id at most once."""
    env: Mapping[str, str] = field(default_factory=dict)
    """What the service tells the node (its URL, the worker token, the checkpoint directory,
    the etcd endpoints); who the node is, the scheduler adds (``service.launch.apps.node_env``)."""
    recovery: RecoveryMode = "restart"
    """``peer``: a one-node torchrun whose workers form the job's group themselves;
    ``restart``: every node's torchrun in one rendezvous across nodes."""
    role: NodeRole = "member"
    """A member of the group, or a warm spare (peer mode)."""


def node_launch(job: JobRecord, node: NodeRecord, env: Mapping[str, str]) -> NodeLaunch:
    """The launch of ``node`` of ``job`` that the reconciler asks its scheduler for: in the job's
    recovery mode and with the node's role. Pure."""
    if job.spec is None:  # only the FAILED stand-in of an unreadable record has none; it launches nothing
        raise InvalidRequestError(f"job {job.id} has no readable spec; nothing of it can be launched")
    return NodeLaunch(
        job.id, job.spec, node.index, node.launch_id, env, recovery=job.recovery_mode, role=node.role
    )


class Scheduler(Protocol):
    """Launches node apps (one torchrun agent each), all of a job sharing one rendezvous id."""

    def launch(self, node: NodeLaunch) -> str:
        """Start one node; returns its handle. Idempotent per ``node.launch_id`` (the same id
        returns the first launch's handle and starts nothing)."""
        ...

    def status(self, handle: str) -> NodeStatus:
        """The node's state now; ``unknown`` when the scheduler has no record of it."""
        ...

    def cancel(self, handle: str) -> None:
        """Stop the node. Idempotent: cancelling an ended or unknown app is not an error."""
        ...

    def log_dir(self, handle: str) -> Path | None:
        """Where the node's log files are, or ``None`` when the service cannot read them (a
        cluster keeps them)."""
        ...

    def close(self) -> None:
        """Release what the scheduler holds (called once, when the service stops)."""
        ...


GangLauncher = Callable[[Sequence[NodeLaunch]], list[str]]


def gang_launcher(scheduler: Scheduler) -> GangLauncher | None:
    """The scheduler's ``launch_gang`` (start nodes together: all of them or none; returns their
    handles in order) when it has one and says ``gangs``; ``None`` when it launches one node at a
    time (the local scheduler's queue already starts a job only when its minimum fits)."""
    if not getattr(scheduler, "gangs", False):
        return None
    launch: GangLauncher = scheduler.launch_gang  # type: ignore[attr-defined]
    return launch
