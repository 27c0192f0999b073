"""The JobSpec's ``recovery`` field: how a job
recovers from a lost rank. Torch-free, like :mod:`worker.jobspec.spec`, which embeds it.

``mode``: ``peer`` — the survivors keep their processes and the lost rank's state comes from
their memory (:mod:`worker.recovery`); ``restart`` — torchrun stops every worker and the job
resumes from the newest checkpoint; ``auto`` — peer for a DDP job under the service, restart for
FSDP and under a bare torchrun (:func:`effective_mode`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field

from worker.jobspec.limits import Frozen

MAX_SPARES = 64
"""The most warm spares a job may keep (``spares``)."""

RecoveryMode = Literal["auto", "peer", "restart"]
DEFAULT_MODE: RecoveryMode = "auto"
"""Peer recovery for DDP jobs under the service, by default."""


class RecoverySpec(Frozen):
    mode: RecoveryMode = Field(
        default=DEFAULT_MODE,
        description=(
            "peer: survivors keep their processes and hand the lost rank's state on from memory; "
            "restart: torchrun restarts every worker from the newest checkpoint; auto: peer for a "
            "DDP job under the service, restart otherwise."
        ),
    )
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=86_400,
        description=(
            "Peer mode: how long a collective waits for a stalled rank before the group drops it "
            "(ELASTRAIN_COLLECTIVE_TIMEOUT_S overrides it)."
        ),
    )
    max_incidents: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Peer mode: the job fails after more recoveries than this (null: no limit).",
    )


def effective_mode(
    mode: str, *, parallelism: str, under_service: bool, gpus: bool = False
) -> Literal["peer", "restart"]:
    """The recovery a job actually runs: peer only under the service (it keeps the group's
    membership in etcd and starts the replacements), for ``peer``, or ``auto`` with DDP on CPU.
    ``auto`` for a job that asks for GPUs (``gpus``) is restart: peer recovery over NCCL is not
    tested (it needs two GPUs), and torch's NCCL watchdog tears down a process whose collective
    failed, so the survivors could not count on keeping their processes. Pure."""
    if not under_service:
        return "restart"
    if mode == "peer" or (mode == "auto" and parallelism == "ddp" and not gpus):
        return "peer"
    return "restart"


def peer_requested(env: Mapping[str, str]) -> bool:
    """The service launched this process in peer mode (``ELASTRAIN_RECOVERY=peer``)."""
    return env.get("ELASTRAIN_RECOVERY") == "peer"


def restart_note(mode: str, *, launched_peer: bool) -> str | None:
    """What the run record and the worker's stderr say when the spec asks for peer recovery and
    this launch cannot give it (a bare torchrun: no service started it in peer mode). Pure."""
    if mode != "peer" or launched_peer:
        return None
    return (
        "recovery.mode is 'peer', but this worker was not started by the service in peer mode (a "
        "bare torchrun, or a launcher of your own): a lost rank is recovered by torchrun's restart "
        "from the newest checkpoint; submit the job to `elastrain serve` for peer recovery"
    )


def refuse_replace(action: str, *, peer: bool, why: str) -> str | None:
    """The one line that refuses ``stragglers.action: replace`` for a job without peer recovery
    (``why``: what its recovery is), or None. Pure."""
    if action != "replace" or peer:
        return None
    return (
        f"field 'stragglers.action': 'replace' needs peer recovery (a spare takes the slow node's "
        f"place from the survivors' memory), but {why}; set 'stragglers.action' to 'report', or "
        "'recovery.mode' to 'peer' and run the job under the service"
    )
