"""Retention for jobs under the service: right after a step is published, delete what the job's
policy no longer keeps (the worker's :func:`~worker.checkpoint.retention.apply_retention`, with
its failpoint), judged on the registry's steps and metrics, and drop them from the registry."""

from __future__ import annotations

from service.checkpoints.registry import Registry
from service.jobs.model import JobRecord
from worker.checkpoint.retention import CheckpointInfo, apply_retention


def retain(registry: Registry, record: JobRecord, *, newest: int) -> list[int]:
    """Apply the job's retention policy now that ``newest`` is published; returns the steps
    deleted. Never deletes ``newest`` (the policy keeps the newest verified step)."""
    if record.spec is None or not record.checkpoint_dir:
        return []  # the stand-in of a record that could not be read: its policy is unknown
    infos = [CheckpointInfo(e.step, e.metrics) for e in registry.entries(record.id)]
    policy = record.spec.checkpoint.retention
    job_dir = record.checkpoint_place
    deleted = apply_retention(job_dir, policy, newest=newest, checkpoints=infos, job=record.id)
    for step in deleted:
        registry.drop(record.id, step)
    return deleted
