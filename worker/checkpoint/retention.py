"""Retention: which published checkpoints to keep and which to delete (pure, torch-free).

Kept: the latest ``keep_latest`` (at least 2, since the newest may be the one a failure hits),
every ``milestone_every_steps``-th step, the best ``keep_best`` by ``best_metric``
(``best_mode`` min or max; checkpoints without the metric never count as best), ``pinned_steps``,
and always the newest verified checkpoint. The caller applies a plan only right after a
successor was published, so nothing is deleted before its successor exists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from worker.spec import RetentionSpec


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
