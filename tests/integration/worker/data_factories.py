"""Data factories a team might write (found through PYTHONPATH as
``tests.integration.worker.data_factories``): one whose batch() fails on a corrupt sample, one
that augments with the global generators."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from worker.datapath.datasets import TensorData, synthetic


class Corrupt:
    """Synthetic data whose sample ``bad`` cannot be read: batch() raises the team's own error."""

    def __init__(self, samples: int | None, seed: int, split: str, bad: int) -> None:
        self.inner: TensorData = synthetic(samples, seed, split)
        self.task, self.meta, self.bad = self.inner.task, self.inner.meta, bad

    def __len__(self) -> int:
        return len(self.inner)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bad in indices.tolist():
            raise ValueError(f"sample {self.bad} is corrupt (checksum mismatch in shard 3)")
        return self.inner.batch(indices)


def corrupt(samples: int | None, seed: int, split: str = "train", *, bad: int = 50) -> Corrupt:
    return Corrupt(samples, seed, split, bad)


class Augmented:
    """Synthetic data with input noise drawn from torch's global generator in batch()."""

    def __init__(self, samples: int | None, seed: int, split: str, noise: float) -> None:
        self.inner: TensorData = synthetic(samples, seed, split)
        self.task, self.meta, self.noise = self.inner.task, self.inner.meta, noise

    def __len__(self) -> int:
        return len(self.inner)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.inner.batch(indices)
        return x + self.noise * torch.randn_like(x), y


def augmented(samples: int | None, seed: int, split: str = "train", *, noise: float = 0.1) -> Any:
    return Augmented(samples, seed, split, noise)
