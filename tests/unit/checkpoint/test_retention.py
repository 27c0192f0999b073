from __future__ import annotations

import pytest

from worker.checkpoint.retention import CheckpointInfo, plan_retention
from worker.jobspec.spec import RetentionSpec


def _ckpts(steps: list[int], loss: dict[int, float] | None = None) -> list[CheckpointInfo]:
    loss = loss or {}
    return [CheckpointInfo(s, {"loss": loss[s]} if s in loss else {}) for s in steps]


STEPS = [10, 20, 30, 40, 50, 60, 70, 80]
LOSS = {10: 0.9, 20: 0.3, 30: 0.5, 40: 0.2, 50: 0.6, 60: 0.7, 70: 0.8, 80: 0.95}


@pytest.mark.parametrize(
    ("policy", "newest", "kept"),
    [
        (RetentionSpec(keep_latest=2), 80, [70, 80]),
        (RetentionSpec(keep_latest=3), 80, [60, 70, 80]),
        (RetentionSpec(keep_latest=2, milestone_every_steps=40), 80, [40, 70, 80]),
        (RetentionSpec(keep_latest=2, keep_best=2), 80, [20, 40, 70, 80]),
        (RetentionSpec(keep_latest=2, keep_best=1, best_mode="max"), 80, [70, 80]),
        (RetentionSpec(keep_latest=2, keep_best=1, best_metric="acc"), 80, [70, 80]),
        (RetentionSpec(keep_latest=2, pinned_steps=(10, 999)), 80, [10, 70, 80]),
        (RetentionSpec(keep_latest=2), 30, [30, 70, 80]),  # newest verified is never deleted
        (RetentionSpec(keep_latest=10), 80, STEPS),
    ],
)
def test_retention_table(policy: RetentionSpec, newest: int, kept: list[int]) -> None:
    plan = plan_retention(_ckpts(STEPS, LOSS), policy, newest_verified=newest)
    assert sorted(plan.keep) == kept
    assert sorted(plan.delete) == sorted(set(STEPS) - set(kept))


def test_reasons_are_listed() -> None:
    plan = plan_retention(
        _ckpts(STEPS, LOSS),
        RetentionSpec(keep_latest=2, keep_best=1, milestone_every_steps=40),
        newest_verified=80,
    )
    assert plan.keep[80] == ("latest", "milestone", "newest verified")
    assert plan.keep[40] == ("milestone", "best")


def test_nan_never_best_and_ties_prefer_newer() -> None:
    ck = _ckpts([1, 2, 3], {1: float("nan"), 2: 0.5, 3: 0.5})
    plan = plan_retention(ck, RetentionSpec(keep_latest=2, keep_best=1), newest_verified=3)
    assert "best" in plan.keep[3] and 1 in plan.delete


def test_keep_latest_below_two_is_refused_by_the_spec() -> None:
    with pytest.raises(ValueError):
        RetentionSpec(keep_latest=1)


def test_empty() -> None:
    assert plan_retention([], RetentionSpec(), newest_verified=None).delete == ()
