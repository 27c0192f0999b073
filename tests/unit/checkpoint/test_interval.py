from __future__ import annotations

import math

import pytest

from worker.checkpoint.interval import (
    DEFAULT_MTBF_SECONDS,
    MIN_AUTO_SECONDS,
    IntervalPolicy,
    auto_interval_seconds,
    observed_mtbf,
    policy_from_spec,
    should_save,
    young_daly_seconds,
)
from worker.jobspec.spec import CheckpointSpec


def test_young_daly() -> None:
    assert young_daly_seconds(2.0, 3600.0) == pytest.approx(120.0)
    assert young_daly_seconds(30.0, 86400.0) == pytest.approx(math.sqrt(2 * 30 * 86400))
    with pytest.raises(ValueError):
        young_daly_seconds(0.0, 10.0)


def test_auto_uses_spec_mtbf_then_observed_then_default() -> None:
    p = IntervalPolicy("auto", mtbf_seconds=5000.0)
    assert auto_interval_seconds(p, save_cost_s=10.0, observed_mtbf_s=1.0) == pytest.approx(
        math.sqrt(2 * 10 * 5000)
    )
    p = IntervalPolicy("auto")
    assert auto_interval_seconds(p, save_cost_s=10.0, observed_mtbf_s=800.0) == pytest.approx(
        math.sqrt(16000)
    )
    assert auto_interval_seconds(p, save_cost_s=None, observed_mtbf_s=None) == pytest.approx(
        math.sqrt(2 * 1.0 * DEFAULT_MTBF_SECONDS)
    )
    assert auto_interval_seconds(p, save_cost_s=1e-6, observed_mtbf_s=1.0) == MIN_AUTO_SECONDS


def test_observed_mtbf() -> None:
    assert observed_mtbf(1000.0, 0) is None
    assert observed_mtbf(1000.0, 4) == 250.0


def test_policy_from_spec() -> None:
    assert policy_from_spec(CheckpointSpec(interval_steps=5)) == IntervalPolicy("steps", steps=5)
    assert policy_from_spec(CheckpointSpec(interval_seconds=2.5)) == IntervalPolicy("seconds", seconds=2.5)
    assert policy_from_spec(CheckpointSpec(interval="auto", mtbf_seconds=9.0)).mode == "auto"
    assert policy_from_spec(CheckpointSpec()).mode == "final_only"


def test_steps_fall_on_multiples() -> None:
    p = IntervalPolicy("steps", steps=5)
    due = [s for s in range(1, 21) if should_save(p, step=s, now=0, last_save_step=None, last_save_time=0)]
    assert due == [5, 10, 15, 20]
    assert not should_save(p, step=10, now=0, last_save_step=10, last_save_time=0)


def test_seconds_and_final_only() -> None:
    p = IntervalPolicy("seconds", seconds=60.0)
    assert not should_save(p, step=3, now=159.0, last_save_step=1, last_save_time=100.0)
    assert should_save(p, step=3, now=160.0, last_save_step=1, last_save_time=100.0)
    assert not should_save(
        IntervalPolicy("final_only"), step=3, now=1e9, last_save_step=None, last_save_time=0
    )


def test_auto_due_after_interval() -> None:
    p = IntervalPolicy("auto", mtbf_seconds=3600.0)
    every = auto_interval_seconds(p, save_cost_s=2.0, observed_mtbf_s=None)
    kw = {"step": 9, "last_save_step": 1, "last_save_time": 0.0, "save_cost_s": 2.0}
    assert not should_save(p, now=every - 1, **kw)  # type: ignore[arg-type]
    assert should_save(p, now=every, **kw)  # type: ignore[arg-type]
