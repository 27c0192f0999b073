"""Loss-scaler transitions (pure)."""

from __future__ import annotations

from worker.amp import ScalerState, next_scale
from worker.spec import LossScaleSpec

CFG = LossScaleSpec(init_scale=1024.0, growth_interval=3, min_scale=1.0)


def test_skip_halves_scale_and_counts() -> None:
    state = next_scale(ScalerState(scale=1024.0, good_steps=2), True, CFG, enabled=True)
    assert state == ScalerState(scale=512.0, good_steps=0, skipped_total=1)


def test_growth_after_interval_of_good_steps() -> None:
    state = ScalerState(scale=8.0)
    for _ in range(3):
        state = next_scale(state, False, CFG, enabled=True)
    assert state.scale == 16.0 and state.good_steps == 0


def test_scale_never_below_minimum_and_fixed_when_disabled() -> None:
    assert next_scale(ScalerState(scale=1.0), True, CFG, enabled=True).scale == 1.0
    disabled = next_scale(ScalerState(scale=1.0), True, CFG, enabled=False)
    assert disabled.scale == 1.0 and disabled.skipped_total == 1
