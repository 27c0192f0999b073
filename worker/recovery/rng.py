"""Random streams re-derived at every window from (seed, version, rank).

A replaced rank must draw exactly the dropout masks the lost rank would have drawn, without its
memory: so every window starts from generators seeded by a pure function of the job's seed,
the window's version (committed windows so far, skipped fp16 windows included, so that a skipped
window and its retry differ) and the rank in the generation. Call :func:`derive_window_rng` at the
start of each window, before anything draws, and after a re-formation's settle iteration.

It seeds python's ``random``, numpy's global generator, ``torch.default_generator`` and, where
CUDA is initialised, every CUDA default generator — not through ``torch.manual_seed``, which
seeds every device type and costs ~106-146 us against ~12-16 us for the three generators here.
The seed is :func:`worker.checkpoint.rng.derived_seed`'s, the one formula
for derived streams.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from worker.checkpoint.rng import derived_seed


def derive_window_rng(seed: int, version: int, rank: int) -> int:
    """Seed this process's generators for the window at ``version`` on ``rank``; returns the seed."""
    s = derived_seed(seed, version, rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for generator in torch.cuda.default_generators:
            generator.manual_seed(s)
    return s
