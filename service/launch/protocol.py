"""What the reconciler needs from a scheduler: launch a node, ask about it, cancel it, say
where its logs are, and close. :class:`service.launch.torchx_scheduler.TorchXScheduler`
implements it; tests implement it with fakes (in memory, or files a test process writes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from worker.spec import JobSpec

NodeState = Literal["running", "succeeded", "failed", "unknown"]


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What the scheduler knows about one node app. ``exit_code`` is known for ended local nodes
    (``128 + signal`` when killed) and is ``0`` for any succeeded node."""

    state: NodeState
    exit_code: int | None = None
    message: str = ""


UNKNOWN = NodeStatus("unknown")


class Scheduler(Protocol):
    """Launches node apps (one torchrun agent each), all of a job sharing one rendezvous id."""

    def launch(
        self, job_id: str, spec: JobSpec, node_index: int, env: Mapping[str, str], *, launch_id: str
    ) -> str:
        """Start one node; returns its handle. Idempotent per ``launch_id`` (the same id returns
        the first launch's handle and starts nothing)."""
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
