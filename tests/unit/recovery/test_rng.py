"""Per-window random streams: a function of (seed, version, rank) alone, whatever was drawn
before; they seed the process's default generators without torch.manual_seed. (That two
processes derive the same streams is tests/integration/recovery/test_rng_processes.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from worker.recovery.rng import derive_window_rng


def draws() -> tuple[float, float, list[float], list[bool]]:
    mask = torch.nn.functional.dropout(torch.ones(16), p=0.5).bool().tolist()
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), mask


def test_same_inputs_same_streams_whatever_came_before() -> None:
    derive_window_rng(7, 12, 1)
    first = draws()
    for _ in range(5):  # a different history of draws
        draws()
    torch.manual_seed(999)
    derive_window_rng(7, 12, 1)
    assert draws() == first


@pytest.mark.parametrize("other", [(8, 12, 1), (7, 13, 1), (7, 12, 2)])
def test_any_input_changes_every_stream(other: tuple[int, int, int]) -> None:
    derive_window_rng(7, 12, 1)
    base = draws()
    derive_window_rng(*other)
    changed = draws()
    assert all(a != b for a, b in zip(base, changed, strict=True))


def test_it_seeds_the_default_generators_not_through_manual_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(seed: int) -> None:
        raise AssertionError("torch.manual_seed seeds every device type; the derivation must not call it")

    monkeypatch.setattr(torch, "manual_seed", refuse)
    private = torch.Generator().manual_seed(5)
    expected_private = torch.rand(4, generator=torch.Generator().manual_seed(5)).tolist()
    seed = derive_window_rng(1, 2, 3)
    assert torch.initial_seed() == seed  # the default generator carries the derived seed
    assert torch.rand(4, generator=private).tolist() == expected_private  # other generators untouched
