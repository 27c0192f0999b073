"""Two processes derive identical random streams for the same (seed, version, rank): a replaced
rank draws the lost rank's dropout masks without its memory."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest

pytestmark = pytest.mark.integration


def draw(seed: int, windows: list[tuple[int, int]], noise: int, out: Any) -> None:
    import random

    import numpy as np
    import torch

    from worker.recovery.rng import derive_window_rng

    torch.manual_seed(noise)  # each process has its own history before the window
    torch.rand(noise)
    drawn = []
    for version, rank in windows:
        derive_window_rng(seed, version, rank)
        mask = torch.nn.functional.dropout(torch.ones(64), p=0.5).tolist()
        drawn.append((random.random(), float(np.random.rand()), torch.rand(4).tolist(), mask))
    out.put(drawn)


def streams(windows: list[tuple[int, int]], noise: int) -> list[Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=draw, args=(7, windows, noise, out))
    proc.start()
    value = out.get(timeout=120)
    proc.join(60)
    return list(value)


def test_two_processes_draw_the_same_streams() -> None:
    (first,) = streams([(12, 1)], noise=3)
    again, other_rank = streams([(12, 1), (12, 2)], noise=9)
    assert again == first
    assert other_rank != first  # another rank draws other masks
