"""Underflow watch: gradients that vanish do not trip the non-finite check, so measure them.

Every step (cheap: one fused norm) a parameter whose gradient is exactly zero, or absent,
extends its run of steps without an update signal; every ``every_steps`` the exact fraction of
zero gradient elements and the smallest non-zero gradient magnitude are measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class GradStats:
    zero_fraction: float
    min_nonzero: float
    stale_params: tuple[str, ...]


class GradMonitor:
    def __init__(self, names: list[str], *, stale_after: int) -> None:
        self.names = names
        self.stale_after = stale_after
        self.zero_run = torch.zeros(len(names), dtype=torch.int64)

    def observe(self, norms: list[torch.Tensor | None]) -> None:
        """Count consecutive steps in which each parameter got an all-zero (or no) gradient,
        given each parameter's gradient norm (None: no gradient)."""
        present = [n for n in norms if n is not None]
        flags = iter((torch.stack(present) == 0).tolist() if present else [])
        zero = torch.tensor([True if n is None else next(flags) for n in norms], dtype=torch.bool)
        self.zero_run = (self.zero_run + 1) * zero

    def measure(self, grads: list[torch.Tensor | None]) -> GradStats:
        total = zeros = 0
        smallest = float("inf")
        for grad in grads:
            if grad is None:
                continue
            flat = grad.detach().reshape(-1)
            total += flat.numel()
            nonzero = flat[flat != 0]
            zeros += flat.numel() - nonzero.numel()
            if nonzero.numel():
                smallest = min(smallest, float(nonzero.abs().min()))
        stale = tuple(
            n for n, run in zip(self.names, self.zero_run.tolist(), strict=True) if run >= self.stale_after
        )
        return GradStats(
            zero_fraction=zeros / total if total else 1.0,
            min_nonzero=smallest if smallest != float("inf") else 0.0,
            stale_params=stale,
        )

    def state_dict(self) -> dict[str, list[int]]:
        return {"zero_run": self.zero_run.tolist()}

    def load_state_dict(self, raw: dict[str, list[int]]) -> None:
        if len(raw["zero_run"]) == len(self.names):
            self.zero_run = torch.tensor(raw["zero_run"], dtype=torch.int64)
