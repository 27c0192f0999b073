"""When to checkpoint (pure): fixed steps, fixed seconds, or Young/Daly.

Young/Daly: the interval that minimises expected lost work plus checkpoint overhead is about
``sqrt(2 * C * MTBF)`` for a save cost ``C`` (seconds training is blocked per save) and a mean
time between failures ``MTBF``. ``C`` is measured from the saves so far; MTBF comes from the spec
or, failing that, from the restarts observed (elapsed time / restarts), else a default of a day.
With ``interval: fixed`` and neither steps nor seconds set, only the final step is saved (the
trainer always saves it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from worker.jobspec.spec import CheckpointSpec

DEFAULT_MTBF_SECONDS = 24 * 3600.0
#: Assumed save cost before the first save has been measured.
INITIAL_COST_SECONDS = 1.0
#: Never checkpoint more often than this under ``auto`` (protects against C ~ 0).
MIN_AUTO_SECONDS = 10.0

Mode = Literal["steps", "seconds", "auto", "final_only"]


@dataclass(frozen=True, slots=True)
class IntervalPolicy:
    mode: Mode
    steps: int | None = None
    seconds: float | None = None
    mtbf_seconds: float | None = None


def policy_from_spec(cfg: CheckpointSpec) -> IntervalPolicy:
    if cfg.interval == "auto":
        return IntervalPolicy("auto", mtbf_seconds=cfg.mtbf_seconds)
    if cfg.interval_steps is not None:
        return IntervalPolicy("steps", steps=cfg.interval_steps)
    if cfg.interval_seconds is not None:
        return IntervalPolicy("seconds", seconds=cfg.interval_seconds)
    return IntervalPolicy("final_only")


def young_daly_seconds(cost_s: float, mtbf_s: float) -> float:
    """``sqrt(2 * C * MTBF)``; both must be positive."""
    if cost_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"save cost ({cost_s}) and MTBF ({mtbf_s}) must be positive")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def observed_mtbf(elapsed_s: float, restarts: int) -> float | None:
    """MTBF from restarts seen so far, or None before the first restart."""
    return elapsed_s / restarts if restarts > 0 and elapsed_s > 0 else None


def auto_interval_seconds(
    policy: IntervalPolicy, *, save_cost_s: float | None, observed_mtbf_s: float | None
) -> float:
    """The seconds between saves under ``auto``."""
    mtbf = policy.mtbf_seconds or observed_mtbf_s or DEFAULT_MTBF_SECONDS
    cost = save_cost_s if save_cost_s and save_cost_s > 0 else INITIAL_COST_SECONDS
    return max(MIN_AUTO_SECONDS, young_daly_seconds(cost, mtbf))


def should_save(
    policy: IntervalPolicy,
    *,
    step: int,
    now: float,
    last_save_step: int | None,
    last_save_time: float,
    save_cost_s: float | None = None,
    observed_mtbf_s: float | None = None,
) -> bool:
    """Whether ``step`` is due. Step-based saves fall on multiples of ``steps`` so that an
    interrupted and an uninterrupted run checkpoint the same steps."""
    if step <= 0 or step == last_save_step:
        return False
    if policy.mode == "steps":
        assert policy.steps is not None
        return step % policy.steps == 0
    if policy.mode == "seconds":
        assert policy.seconds is not None
        return now - last_save_time >= policy.seconds
    if policy.mode == "auto":
        every = auto_interval_seconds(policy, save_cost_s=save_cost_s, observed_mtbf_s=observed_mtbf_s)
        return now - last_save_time >= every
    return False
