"""Batches loaded ahead on a background thread are the ones the training thread would have loaded,
in the sampler's order; a failing batch() stops the step that reaches it with the user's error;
loading stops when asked; a dataset that draws from the global generators is found."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from worker.checkpoint.rng import capture_rng
from worker.datapath.datasets import synthetic, tokens
from worker.datapath.feed import (
    DEFAULT_DEPTH,
    RANDOM_BATCH_NOTE,
    Feed,
    PrefetchFeed,
    choose_depth,
    make_feed,
    probe,
)
from worker.datapath.sampler import SamplerState
from worker.datapath.trace import rng_fingerprint


def feed(data: Any, depth: int, *, rank: int = 1, world: int = 3, b: int = 4, a: int = 2) -> Feed:
    return make_feed(
        data, depth=depth, seed=7, rank=rank, world_size=world, micro_batch=b, accum_steps=a,
        device=torch.device("cpu"),
    )  # fmt: skip


def train(f: Feed, windows: int, state: SamplerState | None = None) -> list[tuple[list[int], Any]]:
    """What a training loop takes from ``f`` over ``windows`` windows."""
    state = state or SamplerState()
    out = []
    for _ in range(windows):
        window = f.plan(state)
        out += [(m.indices.tolist(), m.inputs) for m in f.batches(state, window)]
        state = window.after
    return out


def test_prefetched_batches_are_the_inline_ones_in_order_across_epochs() -> None:
    """W=3, A=2, b=4 over 50 samples: windows of 24, a short one at the epoch's end (2), a new
    epoch's permutation after it."""
    data = synthetic(50, 0)
    inline, ahead = feed(data, 0), feed(data, 3)
    try:
        expected, got = train(inline, 8), train(ahead, 8)
    finally:
        ahead.close()
    assert [i for i, _ in got] == [i for i, _ in expected]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(got, expected, strict=True))
    # windows of 24, 24, 2 (one micro-step) in each epoch: 2+2+1 + 2+2+1 + 2+2 micro-batches
    assert len(expected) == 14 and [i for i, _ in expected][4] != [i for i, _ in expected][9]


def test_a_request_from_another_state_is_served_from_there() -> None:
    data = tokens(64, 0)
    ahead = feed(data, 2)
    try:
        train(ahead, 1)  # loads ahead from the start
        elsewhere = SamplerState(0, 40)  # as after a resume or a skipped window elsewhere
        got = train(ahead, 2, elsewhere)
    finally:
        ahead.close()
    assert [i for i, _ in got] == [i for i, _ in train(feed(data, 0), 2, elsewhere)]


class Failing:
    """Fails on the ``bad``-th call of batch(), with the user's own error."""

    task, meta = "regression", {}

    def __init__(self, bad: int) -> None:
        self.bad, self.calls = bad, 0

    def __len__(self) -> int:
        return 64

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        if self.calls == self.bad:
            raise KeyError("shard 17 is not in the bucket")
        return torch.zeros(len(indices), 2), torch.zeros(len(indices), 1)


@pytest.mark.parametrize("depth", [0, 1, 4])
def test_a_failing_batch_raises_the_users_error_at_the_step_that_needs_it(depth: int) -> None:
    f = feed(Failing(bad=5), depth, rank=0, world=1)
    taken: list[list[int]] = []
    state = SamplerState()
    with pytest.raises(KeyError, match="shard 17 is not in the bucket"):
        for _ in range(10):
            window = f.plan(state)
            taken += [m.indices.tolist() for m in f.batches(state, window)]
            state = window.after
    f.close()
    assert len(taken) == 4  # the four micro-batches before it were trained on


def test_a_failure_past_the_last_step_is_never_raised() -> None:
    """The loader runs ahead of the run's end: a batch the run does not train cannot stop it."""
    f = feed(Failing(bad=5), 4, rank=0, world=1)
    assert len(train(f, 2)) == 4
    f.close()


def test_the_loader_wakes_once_per_half_buffer_not_once_per_batch() -> None:
    """A training thread slower than the loader (the usual case): the loader fills the buffer and
    sleeps until half of it is taken."""
    f = feed(synthetic(256, 0), 4, rank=0, world=1, b=4, a=2)
    assert isinstance(f, PrefetchFeed)
    state = SamplerState()
    for _ in range(12):  # 24 micro-batches
        window = f.plan(state)
        for _ in f.batches(state, window):
            time.sleep(0.002)  # the step's compute
        state = window.after
    loader = f._loader
    assert loader is not None
    wakeups = loader.buffer.loader_wakeups
    f.close()
    assert 0 < wakeups <= 24 // 2 + 1


class Slow:
    """batch() blocks until released: the loader is stuck inside it when asked to stop."""

    task, meta = "regression", {}

    def __init__(self) -> None:
        self.release = threading.Event()

    def __len__(self) -> int:
        return 64

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if threading.current_thread().name == "elastrain-data":
            self.release.wait(timeout=30)
        return torch.zeros(len(indices), 2), torch.zeros(len(indices), 1)


def test_close_stops_the_loading_thread_with_a_full_buffer_and_is_idempotent() -> None:
    f = feed(synthetic(64, 0), 2)
    assert isinstance(f, PrefetchFeed)
    train(f, 1)  # then the loader fills its buffer and waits, as nothing takes from it
    loader = f._loader
    assert loader is not None
    f.close()
    f.close()
    assert not loader.thread.is_alive() and f._loader is None


def test_close_does_not_wait_for_a_batch_that_never_returns() -> None:
    """And a training thread still waiting on the closed feed gets an error, not a hang."""
    slow = Slow()
    f = feed(slow, 2)
    state = SamplerState()
    window = f.plan(state)
    batches = f.batches(state, window)
    errors: list[BaseException] = []

    def step() -> None:
        try:
            next(batches)
        except RuntimeError as exc:
            errors.append(exc)

    waiting = threading.Thread(target=step, daemon=True)
    waiting.start()
    waiting.join(timeout=0.5)  # the training thread is waiting for a batch stuck in batch()
    loader = f._loader
    f.close()  # returns: the loader is a daemon thread, which cannot keep the process alive
    assert loader is not None and loader.thread.daemon and loader.buffer.stopped
    slow.release.set()
    loader.thread.join(timeout=30)
    assert not loader.thread.is_alive()  # released, it stops instead of loading on
    waiting.join(timeout=30)
    assert [str(e) for e in errors] == ["the data loading thread stopped without a batch"]


class Augmenting:
    """batch() draws from one of the global generators (an augmentation)."""

    task, meta = "regression", {}

    def __init__(self, source: str) -> None:
        self.source = source

    def __len__(self) -> int:
        return 16

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        noise = {
            "torch": lambda: float(torch.rand(())),
            "numpy": lambda: float(np.random.rand()),
            "python": random.random,
        }[self.source]()
        return torch.full((len(indices), 2), noise), torch.zeros(len(indices), 1)


@pytest.mark.parametrize("source", ["torch", "numpy", "python"])
def test_a_batch_that_draws_from_a_global_generator_is_found_and_leaves_no_trace(source: str) -> None:
    before = rng_fingerprint(capture_rng())
    assert probe(Augmenting(source), 4)[0]
    assert rng_fingerprint(capture_rng()) == before


def test_the_built_in_data_draws_nothing() -> None:
    assert not probe(synthetic(16, 0), 4)[0]
    assert not probe(tokens(16, 0), 4)[0]


class Costly:
    """batch() takes ``seconds`` (or returns prepared tensors at once); counts its calls."""

    task, meta = "regression", {}

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.calls = seconds, 0
        self.x, self.y = torch.zeros(4, 2), torch.zeros(4, 1)

    def __len__(self) -> int:
        return 16

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        if self.seconds:
            time.sleep(self.seconds)
        return self.x[: len(indices)], self.y[: len(indices)]


CPU, GPU = torch.device("cpu"), torch.device("cuda")  # a device descriptor: nothing runs on it


def test_unset_prefetch_loads_a_fast_batch_between_micro_steps_on_cpu_and_says_so() -> None:
    depth, notes = choose_depth(None, Costly(), count=4, device=CPU)
    assert depth == 0 and len(notes) == 1 and notes[0].startswith("data.prefetch unset: a batch() took")


def test_unset_prefetch_loads_ahead_when_batch_waits_or_on_a_gpu() -> None:
    assert choose_depth(None, Costly(seconds=0.002), count=4, device=CPU) == (DEFAULT_DEPTH, ())
    assert choose_depth(None, Costly(), count=4, device=GPU) == (DEFAULT_DEPTH, ())


def test_a_given_prefetch_is_kept_unless_batch_draws_from_the_global_generators() -> None:
    assert choose_depth(3, Costly(), count=4, device=CPU) == (3, ())
    assert choose_depth(3, Augmenting("numpy"), count=4, device=GPU) == (0, (RANDOM_BATCH_NOTE,))
    never = Costly()
    assert choose_depth(0, never, count=4, device=CPU) == (0, ()) and never.calls == 0
