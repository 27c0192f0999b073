"""The sampler's promise: every sample exactly once per epoch, at any world size, across changes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from worker.datapath.sampler import SamplerState, epoch_order, indices, plan_window, split_evenly


def consume(
    state: SamplerState, *, size: int, world: int, b: int, a: int, steps: int, seed: int = 7
) -> tuple[SamplerState, list[int]]:
    seen: list[int] = []
    for _ in range(steps):
        window = plan_window(state, dataset_size=size, world_size=world, micro_batch=b, accum_steps=a)
        for micro in window.micro_steps:
            for rank in range(world):
                seen.extend(indices(seed, window.epoch, size, micro.bounds[rank]).tolist())
        state = window.after
    return state, seen


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_index_once_per_epoch(world: int) -> None:
    size, b, a = 103, 4, 2  # 103 does not divide: the last window is short and uneven
    per_step = world * b * a
    steps = -(-size // per_step)
    state, seen = consume(SamplerState(), size=size, world=world, b=b, a=a, steps=steps)
    assert sorted(seen) == list(range(size))
    assert state == SamplerState(epoch=1, cursor=0)


def test_world_size_change_mid_epoch_keeps_exactly_once() -> None:
    size = 100
    state, first = consume(SamplerState(), size=size, world=2, b=4, a=1, steps=5)  # 40 samples
    assert state.cursor == 40
    state, rest = consume(state, size=size, world=3, b=4, a=1, steps=5)  # 60 samples at W=3
    assert Counter(first + rest) == Counter(range(size))
    assert state.epoch == 1


def test_order_depends_only_on_seed_and_epoch() -> None:
    assert np.array_equal(epoch_order(1, 0, 50), epoch_order(1, 0, 50))
    assert not np.array_equal(epoch_order(1, 0, 50), epoch_order(1, 1, 50))
    assert not np.array_equal(epoch_order(1, 0, 50), epoch_order(2, 0, 50))


def test_short_micro_step_is_split_evenly_and_may_leave_a_rank_empty() -> None:
    assert split_evenly(10, 5, 2) == ((10, 12), (12, 15))
    assert split_evenly(0, 1, 3) == ((0, 0), (0, 0), (0, 1))


def test_last_window_of_epoch_has_fewer_micro_steps() -> None:
    window = plan_window(SamplerState(0, 90), dataset_size=100, world_size=2, micro_batch=4, accum_steps=4)
    assert window.samples == 10
    assert [m.samples for m in window.micro_steps] == [8, 2]
    assert window.after == SamplerState(1, 0)
