"""A data factory whose ``batch()`` costs a set time: the benchmarks' model of data on slow storage.

``kind="io"`` waits (``time.sleep``: a read from a network filesystem or an object store, which
holds neither a core nor the GIL); ``kind="cpu"`` computes for that long (numpy work, as decoding
or augmenting does, on a core). The batches are the built-in synthetic set's, so a run with this
data trains the same bits as one with ``{"name": "synthetic"}`` and the same kwargs.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from worker.datapath.datasets import TensorData, synthetic


class Slow:
    def __init__(self, inner: TensorData, cost_s: float, kind: str) -> None:
        if kind not in ("io", "cpu"):
            raise ValueError("kind must be io or cpu")
        self.inner, self.cost_s, self.kind = inner, cost_s, kind
        self.task, self.meta = inner.task, inner.meta
        self._work = np.random.default_rng(0).standard_normal(4096)

    def __len__(self) -> int:
        return len(self.inner)

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "io":
            time.sleep(self.cost_s)
        else:
            deadline = time.perf_counter() + self.cost_s
            while time.perf_counter() < deadline:
                np.sort(self._work)
        return self.inner.batch(indices)


def slow(
    samples: int | None,
    seed: int,
    split: str = "train",
    *,
    cost_ms: float = 5.0,
    kind: str = "io",
    **kwargs: Any,
) -> Slow:
    """``synthetic(samples, seed, split, **kwargs)`` whose every ``batch()`` costs ``cost_ms``."""
    return Slow(synthetic(samples, seed, split, **kwargs), cost_ms / 1000.0, kind)
