"""Loss-scaler transitions (pure)."""

from __future__ import annotations

from worker.jobspec.spec import LossScaleSpec
from worker.train.amp import ScalerState, next_scale

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


def test_the_precision_table_draws_from_no_generator() -> None:
    """It runs between the RNG restore and the first step of a resumed run, so it must move no
    generator."""
    import torch

    from worker.train.amp import precision_table

    before = torch.get_rng_state()
    table = precision_table("bf16", torch.device("cpu"), {"params": ["fp32"], "optimizer_state": []})
    assert torch.equal(torch.get_rng_state(), before)
    assert table["matmul/linear"]["output"] == "bf16"


def test_the_optimizer_entry_reports_the_real_master_state() -> None:
    import torch

    from worker.train.amp import OPTIMIZER_ROW, precision_table, state_dtypes

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    fresh = state_dtypes(model, opt)
    assert fresh == {"params": ["fp32"], "optimizer_state": []}
    assert (
        "not created yet" in precision_table("fp16", torch.device("cpu"), fresh)[OPTIMIZER_ROW]["accumulate"]
    )
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    assert state_dtypes(model, opt) == {"params": ["fp32"], "optimizer_state": ["fp32"]}
    model.bias.data = model.bias.data.bfloat16()  # a master parameter that is not fp32 is reported
    row = precision_table("fp16", torch.device("cpu"), state_dtypes(model, opt))[OPTIMIZER_ROW]
    assert row == {"input": "bf16+fp32", "accumulate": "fp32", "output": "bf16+fp32"}
