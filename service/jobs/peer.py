"""Which recovery a job runs and how many warm spares it keeps, read from its spec.

A job runs in *peer* mode when its spec says ``recovery.mode: peer``, or ``auto`` (the default)
and the job is DDP and asks for no GPU (``resources.gpu``: peer recovery over NCCL is untested):
the survivors of a lost rank keep their processes and hand the state on from memory
(``worker/recovery``), each node app runs its own one-node torchrun, and the service keeps
``spares`` warm spare node apps. Otherwise (``restart``, or FSDP or GPUs under ``auto``)
torchrun's restart across nodes is the recovery, exactly as before.

These functions are the one place the service reads those spec fields; the record keeps their
answers from submit on (:class:`service.jobs.model.JobRecord` ``recovery_mode``, ``spares``,
``max_incidents``), so nothing else needs the spec for them.
"""

from __future__ import annotations

import json

from service.jobs.model import JobRecord, RecoveryMode
from service.jobs.resources import parse_resources
from worker.errors import SpecError
from worker.jobspec.recovery import effective_mode, refuse_replace
from worker.jobspec.spec import JobSpec


def peer_mode(spec: JobSpec) -> bool:
    """Whether ``spec``'s job recovers from its peers' memory: ``recovery.mode`` ``peer``, or
    ``auto`` for a DDP job that asks for no GPU (every job the service runs is under the service)."""
    mode = effective_mode(
        spec.recovery.mode, parallelism=spec.parallelism, under_service=True, gpus=asks_for_gpus(spec)
    )
    return mode == "peer"


def asks_for_gpus(spec: JobSpec) -> bool:
    """``resources.gpu`` above 0 (how a job gets GPUs on a cluster)."""
    return parse_resources(spec.resources).gpu > 0


def recovery_mode(spec: JobSpec) -> RecoveryMode:
    return "peer" if peer_mode(spec) else "restart"


def recovery_why(spec: JobSpec) -> str:
    """The submitted event's words on the job's recovery, and why (an FSDP job says that its
    sharded state is what rules peer recovery out). Pure."""
    if peer_mode(spec):
        return "recovery peer: survivors keep their processes, a lost rank's state comes from their memory"
    if spec.recovery.mode == "restart":
        return "recovery restart (recovery.mode is 'restart'): a lost rank restarts every worker"
    if spec.parallelism == "ddp":  # auto, with GPUs
        return (
            "recovery restart: the job asks for GPUs (resources.gpu), and peer recovery over NCCL "
            "is untested, so under recovery.mode 'auto' a lost rank restarts every worker from the "
            "newest checkpoint; recovery.mode 'peer' asks for peer recovery anyway"
        )
    return (
        "recovery restart: FSDP state is sharded and no peer holds a lost rank's shard, so a lost "
        "rank restarts every worker from the newest checkpoint"
    )


def spares(spec: JobSpec) -> int:
    """How many warm spare node apps the job keeps."""
    return spec.spares


def max_incidents(spec: JobSpec) -> int | None:
    """The circuit breaker of peer recovery (``recovery.max_incidents``): a job with more peer
    incidents than this fails. None (the default): no limit."""
    return spec.recovery.max_incidents


def check(spec: JobSpec) -> None:
    """Refuse a spec asking for spares, or for stragglers to be replaced, that its recovery cannot
    give (a spare is only ever promoted by peer recovery). Raises :class:`SpecError` naming the
    field and the fix."""
    refused = refuse_replace(spec.stragglers.action, peer=peer_mode(spec), why=_restart_why(spec))
    if refused is not None:
        raise SpecError(refused)
    count = spares(spec)
    if count and not peer_mode(spec):
        raise SpecError(
            f"field 'spares': {count} spares need peer recovery, but {_restart_why(spec)}; set 'spares' "
            "to 0, or 'recovery.mode' to 'peer'"
        )


def _restart_why(spec: JobSpec) -> str:
    """Why this job recovers by restart, in a refusal's words. Pure."""
    mode = spec.recovery.mode
    if mode != "auto":
        return f"recovery.mode is {mode!r}"
    kind = "an FSDP job" if spec.parallelism != "ddp" else "a job asking for GPUs"
    return f"{kind} under recovery.mode 'auto' recovers by restart"


def desired(record: JobRecord) -> bytes | None:
    """The value of the job's etcd ``desired`` key (``service.jobs.keys.group_desired``) as its
    workers read it: ``{"nodes": N, "spares": S, "epoch": E}``, E growing with every change; None
    for a restart-mode job (its workers read none). Pure."""
    if record.recovery_mode != "peer":
        return None
    value = {"nodes": record.desired_nodes, "spares": record.spares, "epoch": record.desired_epoch}
    return json.dumps(value, separators=(",", ":")).encode()
