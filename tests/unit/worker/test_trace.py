"""The sample trace records what the step trained on: batches as batch() returned them, when taken."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from worker.checkpoint.rng import capture_rng
from worker.datapath.datasets import synthetic
from worker.datapath.feed import Feed, make_feed
from worker.datapath.sampler import SamplerState, epoch_order
from worker.datapath.trace import LoadRecorder, rng_fingerprint, spent, thread_clock


def feed(data: object, depth: int) -> Feed:
    return make_feed(
        data, depth=depth, seed=0, rank=0, world_size=1, micro_batch=2, accum_steps=2,  # type: ignore[arg-type]
        device=torch.device("cpu"),
    )  # fmt: skip


@pytest.mark.parametrize("depth", [0, 2])
def test_the_recorder_notes_what_the_step_takes_in_order(depth: int) -> None:
    """Prefetched batches the step has not taken yet (the next window's) are not in the trace."""
    f, recorder = feed(synthetic(32, 0), depth), LoadRecorder()
    window = f.plan(SamplerState())
    taken = [m.indices.tolist() for m in recorder.record(f.batches(SamplerState(), window))]
    f.close()
    assert recorder.take() == taken[0] + taken[1] and recorder.take() == []
    assert sorted(taken[0] + taken[1]) == sorted(epoch_order(0, 0, 32)[:4].tolist())


class Failing:
    task, meta = "regression", {}

    def __len__(self) -> int:
        return 32

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if 0 in indices.tolist() or len(indices) == 0:
            raise IndexError("no sample 0 here")
        return torch.zeros(len(indices), 1), torch.zeros(len(indices), 1)


@pytest.mark.parametrize("depth", [0, 2])
def test_a_batch_that_fails_is_not_recorded(depth: int) -> None:
    f, recorder = feed(Failing(), depth), LoadRecorder()
    state = SamplerState()
    with pytest.raises(IndexError, match="no sample 0 here"):
        while True:
            window = f.plan(state)
            for _ in recorder.record(f.batches(state, window)):
                pass
            state = window.after
    f.close()
    assert 0 not in recorder.take()


def test_the_fingerprint_of_a_state_survives_the_json_a_checkpoint_keeps() -> None:
    state = capture_rng()
    assert rng_fingerprint(json.loads(json.dumps(state))) == rng_fingerprint(state)
    torch.rand(1)
    assert rng_fingerprint(capture_rng()) != rng_fingerprint(state)


def test_what_the_training_thread_spent_splits_its_work_from_its_waiting() -> None:
    """``cpu_s`` counts the thread's own work, not its waits: a busy loop is CPU, a sleep is not
    (the join benchmark reads a first window's excess so)."""
    busy = thread_clock()
    while time.thread_time() - busy[1] < 0.02:
        pass
    worked = spent(busy)
    assert worked["cpu_s"] is not None and worked["cpu_s"] >= 0.02
    assert worked["wall_s"] is not None and worked["wall_s"] >= worked["cpu_s"]
    assert worked["runq_s"] is not None and 0 <= worked["runq_s"] <= worked["wall_s"]  # Linux: /proc reads
    idle = thread_clock()
    time.sleep(0.05)
    slept = spent(idle)
    assert slept["wall_s"] is not None and slept["cpu_s"] is not None
    assert slept["cpu_s"] < slept["wall_s"] / 2
