"""Global batch and LR rules when the world size changes."""

from __future__ import annotations

import math

import pytest

from worker.errors import SpecError
from worker.jobspec.spec import LRScheduleSpec, parse_spec
from worker.train.schedule import lr_at, plan_batch


def spec(**over: object) -> object:
    raw = {
        "name": "t",
        "model": {"name": "mlp"},
        "data": {"name": "synthetic"},
        "micro_batch_size": 8,
        "max_steps": 10,
        **over,
    }
    return parse_spec(raw)


def test_global_batch_kept_by_changing_accumulation() -> None:
    s = spec(global_batch_size=48)
    assert plan_batch(s, 2, reference_batch=None, resuming=False).accum_steps == 3
    assert plan_batch(s, 3, reference_batch=None, resuming=True).accum_steps == 2
    assert plan_batch(s, 6, reference_batch=None, resuming=True).lr_factor == 1.0


def test_global_batch_that_cannot_split_is_bad_input_on_a_fresh_start() -> None:
    with pytest.raises(SpecError, match="global_batch_size"):
        plan_batch(spec(global_batch_size=48), 4, reference_batch=None, resuming=False)


@pytest.mark.parametrize(
    ("rule", "factor"), [("linear", 32 / 48), ("sqrt", math.sqrt(32 / 48)), ("none", 1.0)]
)
def test_resume_that_cannot_keep_the_batch_applies_the_lr_rule(rule: str, factor: float) -> None:
    plan = plan_batch(spec(global_batch_size=48, lr_scaling=rule), 4, reference_batch=None, resuming=True)
    assert (plan.accum_steps, plan.global_batch) == (1, 32)
    assert plan.lr_factor == pytest.approx(factor)
    assert rule in plan.note


def test_fixed_accumulation_scales_lr_against_the_first_run() -> None:
    s = spec(grad_accum_steps=2)
    first = plan_batch(s, 2, reference_batch=None, resuming=False)
    assert first.global_batch == 32 and first.lr_factor == 1.0
    later = plan_batch(s, 4, reference_batch=first.global_batch, resuming=True)
    assert later.global_batch == 64 and later.lr_factor == pytest.approx(2.0)


def test_lr_is_keyed_by_samples_with_warmup_and_decay() -> None:
    sched = LRScheduleSpec(warmup_samples=100, decay="linear", min_lr_ratio=0.1)
    assert lr_at(0, base_lr=1.0, factor=1.0, schedule=sched, total=1100) < 0.02
    assert lr_at(100, base_lr=1.0, factor=1.0, schedule=sched, total=1100) == pytest.approx(1.0)
    assert lr_at(1100, base_lr=1.0, factor=2.0, schedule=sched, total=1100) == pytest.approx(0.2)
    cos = LRScheduleSpec(decay="cosine")
    assert lr_at(50, base_lr=1.0, factor=1.0, schedule=cos, total=100) == pytest.approx(0.5)
