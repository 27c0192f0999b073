"""Underflow watch: gradients that vanish do not trip the non-finite check, so measure them.

Every step (cheap: from the norms the step computes anyway) a parameter whose gradient is exactly
zero, or absent, extends its run of steps without an update signal; every ``every_steps`` the
exact fraction of zero gradient elements and the smallest non-zero gradient magnitude are
measured. All of it is computed on the gradients' device and read with the step's one read (see
:mod:`worker.train.step`): the watch adds no wait for the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MAGNITUDE = 0x7FFFFFFF  # an fp32's bits without the sign
SCRATCH_ELEMENTS = 1 << 22
"""The gradient statistics' int32 scratch buffer, at most (16 MiB); larger gradients go by chunks."""


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
        """Steps in a row each parameter got an all-zero (or no) gradient; on the gradients'
        device once a step has run."""
        self._scratch: torch.Tensor | None = None

    def advance(self, norms: torch.Tensor, present: list[int] | None = None) -> torch.Tensor:
        """The zero runs after a step whose gradients have these ``norms`` (``norms[k]`` is
        parameter ``present[k]``'s; None: every parameter has a gradient). On the device; keep
        them with :meth:`commit` once the step is known not to be skipped."""
        zero = norms == 0
        if present is not None:
            full = torch.ones(len(self.names), dtype=torch.bool, device=norms.device)
            full[torch.tensor(present, dtype=torch.int64, device=norms.device)] = zero
            zero = full
        return (self.zero_run.to(norms.device) + 1) * zero

    def commit(self, zero_run: torch.Tensor) -> None:
        self.zero_run = zero_run

    def pending(self, grads: list[torch.Tensor], *, device: torch.device) -> torch.Tensor:
        """:func:`pending_stats` of ``grads``, through this monitor's scratch buffer (at most
        ``SCRATCH_ELEMENTS``, kept for the next measurement)."""
        largest = max((g.numel() for g in grads if g.dtype == torch.float32), default=0)
        size = min(largest, SCRATCH_ELEMENTS)
        if size and (self._scratch is None or self._scratch.numel() < size or self._scratch.device != device):
            self._scratch = torch.empty(size, dtype=torch.int32, device=device)
        return pending_stats(grads, device=device, scratch=self._scratch if size else None)

    def stats(self, values: list[float], *, numel: int) -> GradStats:
        """The statistics from what was read: the zero runs (one per parameter), then
        :func:`pending_stats`'s two values; ``numel`` is the gradient elements measured."""
        runs, (nonzero, smallest) = values[: len(self.names)], values[len(self.names) :]
        stale = tuple(n for n, run in zip(self.names, runs, strict=True) if run >= self.stale_after)
        return GradStats(
            zero_fraction=(numel - nonzero) / numel if numel else 1.0,
            min_nonzero=smallest if math.isfinite(smallest) else 0.0,
            stale_params=stale,
        )

    def state_dict(self) -> dict[str, list[int]]:
        return {"zero_run": [int(v) for v in self.zero_run.tolist()]}

    def load_state_dict(self, raw: dict[str, list[int]]) -> None:
        if len(raw["zero_run"]) == len(self.names):
            self.zero_run = torch.tensor(raw["zero_run"], dtype=torch.int64)


def pending_stats(
    grads: list[torch.Tensor], *, device: torch.device, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """[non-zero gradient elements, smallest non-zero magnitude (inf: none)] as a float64 vector on
    ``device``, computed there (nothing is read).

    fp32 gradients go through their bits in ``scratch`` (an int32 buffer, reused chunk by chunk:
    a fresh temporary the size of a gradient costs more in page faults than the passes over it).
    Magnitudes of fp32 values order as their bits do: with the sign cleared (so -0.0 is 0),
    ``(bits - 1)`` masked back to 31 bits sends 0 to the largest value and keeps every other
    order, so its minimum is the smallest non-zero magnitude's bits, less one.
    """
    nonzero, lows, smallest = [], [], []
    for grad in grads:
        flat = grad.detach().reshape(-1)
        if flat.dtype != torch.float32 or scratch is None:
            magnitude = flat.abs().float()
            nonzero.append(torch.count_nonzero(magnitude))
            smallest.append(torch.where(magnitude != 0, magnitude, math.inf).amin() if flat.numel() else None)
            continue
        bits = flat.view(torch.int32)
        for start in range(0, bits.numel(), scratch.numel()):
            part = bits[start : start + scratch.numel()]
            buf = torch.bitwise_and(part, _MAGNITUDE, out=scratch[: part.numel()])
            nonzero.append(torch.count_nonzero(buf))
            lows.append(buf.sub_(1).bitwise_and_(_MAGNITUDE).amin())
    if lows:
        low = torch.stack(lows).amin()
        value = (low + 1).view(torch.float32)
        smallest.append(torch.where(low == _MAGNITUDE, torch.full_like(value, math.inf), value))
    found = [v for v in smallest if v is not None]
    least = (
        torch.stack(found).amin().double()
        if found
        else torch.tensor(math.inf, dtype=torch.float64, device=device)
    )
    count = (
        torch.stack(nonzero).sum().double()
        if nonzero
        else torch.zeros((), dtype=torch.float64, device=device)
    )
    return torch.stack([count.to(device), least.to(device)])
