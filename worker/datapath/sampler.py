"""The global sampler: which samples each rank trains on, as a pure function of a small state.

The order of an epoch is a permutation drawn from ``(seed, epoch)`` alone. The state is a
global cursor counted in samples, so it does not depend on the world size: after a restart at
any world size the epoch continues where it stopped and every sample is consumed exactly once.

An optimizer step consumes one *window* of up to ``A * W * b`` samples (A micro-steps of
``W * b``). Windows never cross an epoch boundary: the last window of an epoch is short, and
within a short micro-step the samples are split as evenly as possible, so a rank may get fewer
samples than its neighbours (even none). Losses are therefore weighted by the true sample count.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True, slots=True)
class SamplerState:
    """Where the data stream stands: the epoch and how many of its samples were consumed."""

    epoch: int = 0
    cursor: int = 0

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor}

    @staticmethod
    def from_json(raw: dict[str, int]) -> SamplerState:
        return SamplerState(epoch=int(raw["epoch"]), cursor=int(raw["cursor"]))


@dataclass(frozen=True, slots=True)
class MicroStep:
    """One micro-step: ``bounds[r]`` is rank r's half-open range of epoch positions."""

    bounds: tuple[tuple[int, int], ...]

    @property
    def samples(self) -> int:
        return self.bounds[-1][1] - self.bounds[0][0]


@dataclass(frozen=True, slots=True)
class Window:
    """The samples of one optimizer step, and the state after it."""

    epoch: int
    micro_steps: tuple[MicroStep, ...]
    samples: int
    after: SamplerState


def split_evenly(start: int, count: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``count`` positions from ``start`` in ``parts`` contiguous ranges whose sizes differ by <= 1."""
    return tuple((start + (r * count) // parts, start + ((r + 1) * count) // parts) for r in range(parts))


def plan_window(
    state: SamplerState, *, dataset_size: int, world_size: int, micro_batch: int, accum_steps: int
) -> Window:
    """The next optimizer step's samples for every rank (pure; identical on all ranks)."""
    if dataset_size <= 0 or world_size <= 0 or micro_batch <= 0 or accum_steps <= 0:
        raise ValueError("dataset_size, world_size, micro_batch and accum_steps must be positive")
    epoch, cursor = state.epoch, state.cursor
    if cursor >= dataset_size:
        epoch, cursor = epoch + 1, 0
    per_micro = world_size * micro_batch
    count = min(accum_steps * per_micro, dataset_size - cursor)
    micro = []
    for start in range(cursor, cursor + count, per_micro):
        size = min(per_micro, cursor + count - start)
        micro.append(MicroStep(split_evenly(start, size, world_size)))
    end = cursor + count
    after = SamplerState(epoch + 1, 0) if end >= dataset_size else SamplerState(epoch, end)
    return Window(epoch=epoch, micro_steps=tuple(micro), samples=count, after=after)


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, size: int) -> np.ndarray:
    order = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(size)
    order.setflags(write=False)
    return order


def epoch_order(seed: int, epoch: int, size: int) -> np.ndarray:
    """The dataset indices of an epoch in training order; depends only on (seed, epoch, size)."""
    return _permutation(seed, epoch, size)


def indices(seed: int, epoch: int, size: int, bounds: tuple[int, int]) -> np.ndarray:
    """Dataset indices for a half-open range of epoch positions."""
    return epoch_order(seed, epoch, size)[bounds[0] : bounds[1]]
