"""Retention: which published checkpoints to keep and which to delete (torch-free).

:func:`plan_retention` decides (pure); :func:`apply_retention` deletes what it decided, with the
``before_retention_delete`` failpoint before each deletion. Both the worker (rank 0 under bare
torchrun) and the control plane (for jobs it coordinates) call :func:`apply_retention`.

Kept: the latest ``keep_latest`` (at least 2, since the newest may be the one a failure hits),
every ``milestone_every_steps``-th step, the best ``keep_best`` by ``best_metric``
(``best_mode`` min or max; checkpoints without the metric never count as best), ``pinned_steps``,
and always the newest verified checkpoint. The caller applies a plan only right after a
successor was published, so nothing is deleted before its successor exists.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from worker.checkpoint import remote
from worker.checkpoint.layout import remove_tree, step_dir_name
from worker.checkpoint.owner import owned_by_other
from worker.checkpoint.places import Place, list_published, load_manifest
from worker.errors import CheckpointError
from worker.failpoints import failpoint
from worker.jobspec.spec import RetentionSpec

log = logging.getLogger("elastrain.checkpoint")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    step: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    keep: dict[int, tuple[str, ...]]  # step -> why it is kept
    delete: tuple[int, ...]


def plan_retention(
    checkpoints: Sequence[CheckpointInfo], policy: RetentionSpec, *, newest_verified: int | None
) -> RetentionPlan:
    """Decide per step; every kept step lists its reasons."""
    steps = sorted({c.step for c in checkpoints}, reverse=True)
    why: dict[int, list[str]] = {s: [] for s in steps}
    for s in steps[: policy.keep_latest]:
        why[s].append("latest")
    every = policy.milestone_every_steps
    if every:
        for s in steps:
            if s % every == 0:
                why[s].append("milestone")
    for s in _best(checkpoints, policy):
        why[s].append("best")
    for s in policy.pinned_steps:
        if s in why:
            why[s].append("pinned")
    if newest_verified is not None and newest_verified in why:
        why[newest_verified].append("newest verified")
    keep = {s: tuple(r) for s, r in why.items() if r}
    delete = tuple(sorted(s for s in steps if s not in keep))
    return RetentionPlan(keep=keep, delete=delete)


def _best(checkpoints: Sequence[CheckpointInfo], policy: RetentionSpec) -> list[int]:
    if policy.keep_best <= 0:
        return []
    scored = [(c.metrics[policy.best_metric], c.step) for c in checkpoints if policy.best_metric in c.metrics]
    scored = [(v, s) for v, s in scored if v == v]  # NaN never counts as best
    # Ties go to the newer step.
    if policy.best_mode == "min":
        scored.sort(key=lambda vs: (vs[0], -vs[1]))
    else:
        scored.sort(key=lambda vs: (-vs[0], -vs[1]))
    return [s for _, s in scored[: policy.keep_best]]


def published_infos(job_dir: Place, *, with_metrics: bool = True) -> list[CheckpointInfo]:
    """The published steps of ``job_dir`` with the metrics their manifests hold (none for a
    manifest that cannot be read: it is never kept as "best"). ``with_metrics=False``: the steps
    only, without reading a manifest (each is a parse of every block digest of a step)."""
    infos = []
    for step, path in list_published(job_dir):
        if not with_metrics:
            infos.append(CheckpointInfo(step))
            continue
        try:
            metrics = load_manifest(path, check_files=False).metrics
        except CheckpointError:
            metrics = {}
        infos.append(CheckpointInfo(step, metrics))
    return infos


def apply_retention(
    job_dir: Place,
    policy: RetentionSpec,
    *,
    newest: int,
    checkpoints: Sequence[CheckpointInfo] | None = None,
    job: str | None = None,
) -> list[int]:
    """Delete what :func:`plan_retention` says, right after ``newest`` was published; returns
    the steps deleted. ``checkpoints``: the published steps and their metrics as the caller
    knows them (the control plane's registry); default: read from the manifests in ``job_dir``.
    ``job``: the job applying it; nothing is deleted in a directory another job owns
    (:mod:`worker.checkpoint.owner`). A step that cannot be deleted is logged and kept (the
    next publish tries again)."""
    other = owned_by_other(job_dir, job) if job is not None and isinstance(job_dir, Path) else None
    if other is not None:
        log.warning("retention deletes nothing in %s: it belongs to job %r, not %r", job_dir, other.job, job)
        return []
    infos = (
        published_infos(job_dir, with_metrics=policy.keep_best > 0)
        if checkpoints is None
        else list(checkpoints)
    )
    deleted = []
    for step in plan_retention(infos, policy, newest_verified=newest).delete:
        try:
            failpoint("before_retention_delete")
            if isinstance(job_dir, Path):
                remove_tree(job_dir / step_dir_name(step))
            else:
                remote.delete_step(job_dir / step_dir_name(step))
        except (OSError, CheckpointError) as exc:
            log.warning("retention could not delete step %s in %s: %s", step, job_dir, exc)
            continue
        deleted.append(step)
    return deleted
