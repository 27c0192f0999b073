"""Which recovery a job runs and how many warm spares it keeps, read from its spec (issue 14).

A job runs in *peer* mode when its spec says ``recovery.mode: peer``, or ``auto`` (the default)
and the job is DDP: the survivors of a lost rank keep their processes and hand the state on from
memory (``worker/recovery``), each node app runs its own one-node torchrun, and the service keeps
``spares`` warm spare node apps. Otherwise (``restart``, or FSDP under ``auto``) torchrun's
restart across nodes is the recovery, exactly as before.

These functions are the one place the service reads those spec fields; the record keeps their
answers from submit on (:class:`service.jobs.model.JobRecord` ``recovery_mode``, ``spares``,
``max_incidents``), so nothing else needs the spec for them.

Transitional: the fields come with the worker half of issue 14 (``worker/spec.py``). Until that
is merged they are read with ``getattr`` and a spec without them runs in restart mode with no
spares; after the merge the ``getattr`` calls become plain attribute reads.
"""

from __future__ import annotations

import json
from typing import Any

from service.jobs.model import JobRecord, RecoveryMode
from worker.errors import SpecError
from worker.spec import JobSpec


def _recovery(spec: JobSpec) -> Any:
    return getattr(spec, "recovery", None)


def peer_mode(spec: JobSpec) -> bool:
    """Whether ``spec``'s job recovers from its peers' memory: ``recovery.mode`` ``peer``, or
    ``auto`` for a DDP job. A spec without the ``recovery`` field (before the worker half of
    issue 14) recovers by restart."""
    mode = getattr(_recovery(spec), "mode", "restart")
    return mode == "peer" or (mode == "auto" and spec.parallelism == "ddp")


def recovery_mode(spec: JobSpec) -> RecoveryMode:
    return "peer" if peer_mode(spec) else "restart"


def spares(spec: JobSpec) -> int:
    """How many warm spare node apps the job keeps (0 without the field)."""
    return int(getattr(spec, "spares", 0) or 0)


def max_incidents(spec: JobSpec) -> int | None:
    """The circuit breaker of peer recovery (``recovery.max_incidents``): a job with more peer
    incidents than this fails. None (the default, or without the field): no limit."""
    limit = getattr(_recovery(spec), "max_incidents", None)
    return None if limit is None else int(limit)


def check(spec: JobSpec) -> None:
    """Refuse a spec asking for spares its recovery cannot use (a spare is only ever promoted by
    peer recovery). Raises :class:`SpecError` naming the field and the fix."""
    count = spares(spec)
    if count and not peer_mode(spec):
        mode = getattr(_recovery(spec), "mode", "restart")
        why = f"recovery.mode is {mode!r}"
        if mode == "auto":
            why = "an FSDP job under recovery.mode 'auto' recovers by restart"
        raise SpecError(
            f"field 'spares': {count} spares need peer recovery, but {why}; set 'spares' to 0, or "
            "'recovery.mode' to 'peer'"
        )


def desired(record: JobRecord) -> bytes | None:
    """The value of the job's etcd ``desired`` key (``service.jobs.keys.group_desired``) as its
    workers read it: ``{"nodes": N, "spares": S, "epoch": E}``, E growing with every change; None
    for a restart-mode job (its workers read none). Pure."""
    if record.recovery_mode != "peer":
        return None
    value = {"nodes": record.desired_nodes, "spares": record.spares, "epoch": record.desired_epoch}
    return json.dumps(value, separators=(",", ":")).encode()
