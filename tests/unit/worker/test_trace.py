"""The sample trace records what the data path loaded, after batch() returned."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from worker.checkpoint.rng import capture_rng
from worker.data import synthetic
from worker.trace import LoadRecorder, rng_fingerprint


def test_the_recorder_notes_each_loaded_batch_in_order() -> None:
    recorder = LoadRecorder(synthetic(32, 0))
    x, _ = recorder.batch(np.array([5, 3]))
    recorder.batch(np.array([7]))
    assert recorder.take() == [5, 3, 7] and recorder.take() == []
    assert x.shape[0] == 2 and len(recorder) == 32 and recorder.task == "regression"


def test_a_batch_that_fails_is_not_recorded() -> None:
    recorder = LoadRecorder(synthetic(32, 0))
    with pytest.raises(IndexError):
        recorder.batch(np.array([1, 99]))
    assert recorder.take() == []


def test_the_fingerprint_of_a_state_survives_the_json_a_checkpoint_keeps() -> None:
    state = capture_rng()
    assert rng_fingerprint(json.loads(json.dumps(state))) == rng_fingerprint(state)
    torch.rand(1)
    assert rng_fingerprint(capture_rng()) != rng_fingerprint(state)
