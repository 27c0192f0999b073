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

from worker.spec import LossScaleSpec

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


def precision_table(precision: str, device: torch.device) -> dict[str, dict[str, str]]:
    """Input, accumulate and output dtypes actually in use for the key op classes.

    Inputs and outputs are observed by running each op under the same autocast the model uses;
    accumulation is what the backend documents for that op on this device.
    """
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    x = torch.randn(4, 8, device=device)
    w = torch.randn(8, 8, device=device)
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
    return {
        "matmul/linear": {
            "input": name[lin.dtype] if low else "fp32",
            "accumulate": mm_acc,
            "output": name[lin.dtype],
        },
        "softmax": {"input": name[lin.dtype], "accumulate": "fp32", "output": name[soft.dtype]},
        "log_softmax/cross_entropy": {
            "input": name[lin.dtype],
            "accumulate": "fp32",
            "output": name[logp.dtype],
        },
        "layer_norm": {"input": name[lin.dtype], "accumulate": "fp32", "output": name[norm.dtype]},
        "reduction(sum)": {"input": name[lin.dtype], "accumulate": "fp32", "output": name[red.dtype]},
        "loss": {"input": "fp32", "accumulate": "fp32", "output": "fp32"},
        "gradient all-reduce": {"input": "fp32", "accumulate": "fp32", "output": "fp32"},
        "optimizer (master params, moments)": {"input": "fp32", "accumulate": "fp32", "output": "fp32"},
    }
