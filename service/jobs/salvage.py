"""A job record the service cannot read, and the FAILED record that stands in for it. Pure.

A job key may hold bytes the current code cannot decode into a :class:`JobRecord`: not JSON
(a hand edit, a torn copy), JSON of another shape, a record written by an older or newer
version, a spec that no longer validates, a state this version does not know. Such a record
must stop nothing but its own job. :func:`decode` is what every reader of a job key calls: the
record, or the stand-in :func:`salvage` builds and an :class:`Unreadable` saying why. The
stand-in keeps every field that still validates -- above all the nodes with their handles, so
the reconciler stops what still runs -- and is FAILED with the reason (a job already finished
keeps its final state). Its spec is the stored one if that validates, else ``None``.

Nothing here writes: the leader stores the stand-in, and keeps the bytes as found under
``keys.quarantine(job id)`` (:meth:`service.jobs.service.JobService.quarantine`); until then
readers see the stand-in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from service.jobs import keys
from service.jobs.machine import fail
from service.jobs.model import JobRecord, NodeRecord
from worker.jobspec.jsonlimits import JSONRefused, loads
from worker.jobspec.spec import JobSpec

_MAX_PROBLEM = 400


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A job key whose value is not a record this version can read."""

    job_id: str
    raw: bytes
    revision: int
    problem: str
    """Why, in one line (the first validation errors, or the JSON error)."""


def decode(job_id: str, raw: bytes, revision: int, *, now: float) -> tuple[JobRecord, Unreadable | None]:
    """The record stored under ``job_id``'s key, or its stand-in and why (see the module doc)."""
    try:
        return JobRecord.from_json(raw), None
    except ValidationError as exc:
        problem = _summary(exc)
    except ValueError as exc:  # pragma: no cover - pydantic reports bad JSON as a ValidationError
        problem = str(exc)
    bad = Unreadable(job_id, raw, revision, problem[:_MAX_PROBLEM])
    return salvage(bad, now=now), bad


def salvage(bad: Unreadable, *, now: float) -> JobRecord:
    """The FAILED stand-in for ``bad`` (see the module doc)."""
    fields = _fields(bad.raw)
    fields["id"] = bad.job_id
    spec = _spec(fields.pop("spec", None))
    fields = _valid_fields(fields | {"spec": None})
    record = JobRecord.model_validate({**_placeholders(bad.job_id, now), **fields, "spec": spec})
    reason = (
        f"the service cannot read this job's stored record ({bad.problem}); it failed the job and "
        f"keeps the record as found at {keys.quarantine(bad.job_id)}"
    )
    if record.state.terminal:
        return record.model_copy(update={"reason": reason})
    return fail(record, now, reason=reason)


def _summary(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_url=False)[:3]:
        loc = ".".join(str(p) for p in error["loc"]) or "record"
        parts.append(f"{loc}: {error['msg']}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def _fields(raw: bytes) -> dict[str, Any]:
    try:
        data = loads(raw, max_bytes=max(len(raw), 1), max_depth=64, what="job record")
    except JSONRefused:
        return {}
    if not isinstance(data, dict):
        return {}
    return {name: value for name, value in data.items() if name in JobRecord.model_fields}


def _spec(value: Any) -> JobSpec | None:
    if not isinstance(value, dict):
        return None
    try:
        return JobSpec.model_validate_json(json.dumps(value))
    except (ValidationError, ValueError):
        return None


def _valid_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` without those that do not validate (nodes one by one); always a dict that
    :class:`JobRecord` takes together with the placeholders."""
    if isinstance(fields.get("nodes"), list):
        fields["nodes"] = [n for n in fields["nodes"] if _node(n) is not None]
    else:
        fields.pop("nodes", None)
    for _ in range(len(fields) + 1):
        try:
            JobRecord.model_validate_json(json.dumps({**_placeholders("x", 0.0), **fields}))
        except ValidationError as exc:
            wrong = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
            if not wrong & fields.keys():
                return {k: v for k, v in fields.items() if k in ("id", "spec")}
            fields = {k: v for k, v in fields.items() if k not in wrong or k == "id"}
            continue
        return _typed(fields)
    return {k: v for k, v in fields.items() if k in ("id", "spec")}  # pragma: no cover


def _typed(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields as the record's own types (validated from JSON, as a stored record is)."""
    decoded = JobRecord.model_validate_json(json.dumps({**_placeholders("x", 0.0), **fields}))
    return {name: getattr(decoded, name) for name in fields if name != "spec"}


def _node(value: Any) -> NodeRecord | None:
    try:
        return NodeRecord.model_validate_json(json.dumps(value))
    except (ValidationError, ValueError, TypeError):
        return None


def _placeholders(job_id: str, now: float) -> dict[str, Any]:
    """What a stand-in says for a required field the stored bytes do not give."""
    return {
        "id": job_id,
        "name": job_id,
        "spec": None,
        "spec_hash": "",
        "state_since": now,
        "desired_nodes": 0,
        "min_nodes": 0,
        "max_nodes": 0,
        "nproc_per_node": 1,
        "max_restarts": 0,
        "checkpoint_dir": "",
        "worker_token_hash": "",
        "created_at": now,
        "updated_at": now,
    }
