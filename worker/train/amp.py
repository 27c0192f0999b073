"""Mixed precision: autocast for the forward pass, fp32 master state, dynamic loss scaling.

Parameters and optimizer moments stay fp32; only the forward (and so the backward) runs under
autocast. The non-finite check covers every gradient and its flag is all-reduced with MAX, so
all ranks skip the same step even if their gradients differ (we do not rely on DDP having made
them identical). A skipped step leaves the global step, the LR schedule and weight decay alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from worker.jobspec.spec import LossScaleSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Autocast for the forward pass; a no-op for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


@dataclass(slots=True)
class ScalerState:
    scale: float
    good_steps: int = 0
    skipped_total: int = 0


class DynamicLossScaler:
    """Loss scaling for fp16 (scale fixed at 1 otherwise). Decisions are pure in :meth:`update`."""

    def __init__(self, cfg: LossScaleSpec, *, enabled: bool) -> None:
        self.cfg = cfg
        self.enabled = enabled
        self.state = ScalerState(scale=cfg.init_scale if enabled else 1.0)

    @property
    def scale(self) -> float:
        return self.state.scale

    def unscale(self, grads: Sequence[torch.Tensor]) -> None:
        """Divide every gradient by the scale, in place (nothing to do at scale 1)."""
        if grads and self.state.scale != 1.0:
            torch._foreach_mul_(list(grads), 1.0 / self.state.scale)

    def update(self, found_non_finite: bool) -> None:
        """Back off on a skipped step; grow after ``growth_interval`` good steps in a row."""
        self.state = next_scale(self.state, found_non_finite, self.cfg, enabled=self.enabled)

    def state_dict(self) -> dict[str, float | int]:
        return {
            "scale": self.state.scale,
            "good_steps": self.state.good_steps,
            "skipped_total": self.state.skipped_total,
        }

    def load_state_dict(self, raw: dict[str, Any]) -> None:
        self.state = ScalerState(
            scale=float(raw["scale"]),
            good_steps=int(raw["good_steps"]),
            skipped_total=int(raw["skipped_total"]),
        )


def next_scale(state: ScalerState, found: bool, cfg: LossScaleSpec, *, enabled: bool) -> ScalerState:
    """The scaler's transition (pure)."""
    if found:
        scale = max(cfg.min_scale, state.scale * cfg.backoff_factor) if enabled else state.scale
        return ScalerState(scale=scale, good_steps=0, skipped_total=state.skipped_total + 1)
    good = state.good_steps + 1
    if enabled and good >= cfg.growth_interval:
        return ScalerState(
            scale=state.scale * cfg.growth_factor, good_steps=0, skipped_total=state.skipped_total
        )
    return ScalerState(scale=state.scale, good_steps=good, skipped_total=state.skipped_total)


def any_rank_non_finite(local_norms: list[torch.Tensor], *, device: torch.device) -> bool:
    """Whether any gradient on any rank holds inf or NaN, from per-gradient norms (a non-finite
    element makes its norm non-finite). The flag is all-reduced with MAX, so every rank agrees."""
    flag = torch.zeros(1, dtype=torch.float32, device=device)
    if local_norms:
        flag[0] = (~torch.isfinite(torch.stack(local_norms))).any().float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


OPTIMIZER_ROW = "optimizer (master params, moments)"
NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dtype_label(dtype: torch.dtype) -> str:
    return NAMES.get(dtype, str(dtype).removeprefix("torch."))


def state_dtypes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, list[str]]:
    """The dtypes the master state really has: every parameter, and every floating tensor of the
    optimizer's state (moments; empty until the first step creates them)."""
    params = {dtype_label(p.dtype) for p in model.parameters()}
    moments = set()
    if optimizer is not None:
        for per_param in optimizer.state.values():
            for key, value in per_param.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    moments.add(dtype_label(value.dtype))
    return {"params": sorted(params), "optimizer_state": sorted(moments)}


def optimizer_row(state: dict[str, list[str]]) -> dict[str, str]:
    """The precision table's optimizer entry from :func:`state_dtypes`: gradients reach the
    optimizer in the parameters' dtype, the moments accumulate in theirs."""
    params = "+".join(state["params"]) or "none"
    moments = "+".join(state["optimizer_state"]) or "not created yet (at the first step)"
    return {"input": params, "accumulate": moments, "output": params}


def precision_table(
    precision: str, device: torch.device, state: dict[str, list[str]]
) -> dict[str, dict[str, str]]:
    """Input, accumulate and output dtypes actually in use for the key op classes.

    Inputs and outputs are observed by running each op under the same autocast the model uses, on
    fixed inputs: nothing here draws from a generator (this runs between the RNG restore and the
    first step). Accumulation is what the backend documents for that op on this device. The
    gradient and optimizer entries come from the real master state (:func:`state_dtypes`).
    """
    x = torch.linspace(-2.0, 2.0, 32, device=device).reshape(4, 8)
    w = torch.linspace(-1.0, 1.0, 64, device=device).reshape(8, 8)
    with autocast(precision, device):
        lin = torch.nn.functional.linear(x, w)
        soft = torch.softmax(lin, dim=-1)
        logp = torch.log_softmax(lin, dim=-1)
        norm = torch.nn.functional.layer_norm(lin, (8,))
        red = lin.sum()
    low = precision != "fp32"
    mm_acc = "fp32"
    if device.type == "cuda" and precision == "fp16":
        mm_acc = "fp16" if torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction else "fp32"
    if device.type == "cuda" and precision == "bf16":
        mm_acc = "bf16" if torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction else "fp32"
    act = dtype_label(lin.dtype)
    grads = "+".join(state["params"]) or "none"
    return {
        "matmul/linear": {"input": act if low else "fp32", "accumulate": mm_acc, "output": act},
        "softmax": {"input": act, "accumulate": "fp32", "output": dtype_label(soft.dtype)},
        "log_softmax/cross_entropy": {"input": act, "accumulate": "fp32", "output": dtype_label(logp.dtype)},
        "layer_norm": {"input": act, "accumulate": "fp32", "output": dtype_label(norm.dtype)},
        "reduction(sum)": {"input": act, "accumulate": "fp32", "output": dtype_label(red.dtype)},
        "loss": {"input": "fp32", "accumulate": "fp32", "output": "fp32"},
        "gradient all-reduce": {"input": grads, "accumulate": grads, "output": grads},
        OPTIMIZER_ROW: optimizer_row(state),
    }
