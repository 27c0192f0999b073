"""The user's contract is checked on one micro-batch before any process group: what came back
and what the worker needs, in one line; and the check leaves no trace in the model or the RNG."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from worker.datapath.datasets import TensorData, synthetic, tokens
from worker.errors import SpecError
from worker.start.contract import check_contract
from worker.start.models import MLP, TinyGPT
from worker.train.objective import Objective

CPU = torch.device("cpu")


class Returns(nn.Module):
    """A model whose forward returns ``make(logits)``."""

    def __init__(self, make: Any) -> None:
        super().__init__()
        self.inner = TinyGPT(vocab_size=32, seq_len=16, d_model=8, n_layers=1)
        self.make = make

    def forward(self, x: torch.Tensor) -> Any:
        return self.make(self.inner(x))


def check(model: nn.Module, data: Any, objective: Objective, precision: str = "fp32") -> None:
    check_contract(model, data, objective=objective, micro_batch=4, precision=precision, device=CPU)


def test_a_model_that_returns_a_mapping_without_logits_is_refused_saying_what_came_back() -> None:
    model = Returns(lambda logits: {"scores": logits, "aux": logits.mean()})
    with pytest.raises(SpecError) as info:
        check(model, tokens(64, 0), Objective(task="lm"))
    message = str(info.value)
    assert message.startswith("field 'model.output'")
    assert "dict with keys ['scores', 'aux']" in message
    assert "needs a tensor of logits (batch, sequence, vocabulary)" in message


def test_outputs_of_the_wrong_shape_say_what_the_task_needs() -> None:
    model = Returns(lambda logits: logits[:, 0])  # one step of logits only
    with pytest.raises(SpecError) as info:
        check(model, tokens(64, 0), Objective(task="lm"))
    message = str(info.value)
    assert message.startswith("field 'model.output': the built-in 'lm' loss failed")
    assert "(4, 32)" in message and "token-id targets (batch, sequence)" in message


def test_a_mean_loss_factory_is_refused_before_training() -> None:
    def mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, 32), y.reshape(-1))

    with pytest.raises(SpecError, match=r"^field 'loss.factory': m:mean returned a scalar"):
        check(Returns(lambda x: x), tokens(64, 0), Objective(loss=mean, loss_name="m:mean"))


def test_a_dataset_that_does_not_return_pairs_is_refused() -> None:
    class Bad(TensorData):
        def batch(self, indices: np.ndarray) -> Any:
            return super().batch(indices)[0]

    data = synthetic(64, 0)
    bad = Bad(data.inputs, data.targets, "regression", data.meta)
    with pytest.raises(
        SpecError, match=r"^field 'data.factory': batch\(indices\) must return \(inputs, targets\)"
    ):
        check(MLP(16, 4), bad, Objective(task="regression"))


def test_rows_that_do_not_match_the_indices_are_refused() -> None:
    class Short(TensorData):
        def batch(self, indices: np.ndarray) -> Any:
            x, y = super().batch(indices)
            return x[:1], y[:1]

    data = synthetic(64, 0)
    with pytest.raises(SpecError, match="for 4 indices its inputs are a tensor of shape"):
        check(
            MLP(16, 4),
            Short(data.inputs, data.targets, "regression", data.meta),
            Objective(task="regression"),
        )


def test_a_forward_that_fails_names_the_model() -> None:
    with pytest.raises(SpecError, match=r"^field 'model.factory': the forward failed .*RuntimeError"):
        check(MLP(3, 4), synthetic(64, 0), Objective(task="regression"))  # 16 inputs, not 3


def test_inputs_may_be_a_mapping_of_keyword_arguments() -> None:
    class Keywords(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP(16, 4)

        def forward(self, *, features: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.net(features)
            return out

    class Mapped(TensorData):
        def batch(self, indices: np.ndarray) -> Any:
            x, y = super().batch(indices)
            return {"features": x}, y

    data = synthetic(64, 0)
    check(
        Keywords(), Mapped(data.inputs, data.targets, "regression", data.meta), Objective(task="regression")
    )


def rng_states() -> tuple[Any, ...]:
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_check_leaves_no_trace_in_generators_buffers_or_parameters(precision: str) -> None:
    torch.manual_seed(5)
    model = MLP(16, 4, norm="batch", dropout=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = rng_states()
    check(model, synthetic(64, 0), Objective(task="regression"), precision)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a buffer or parameter changed"
    assert rng_states() == rng, "the check drew from a training generator"
    assert model.training and all(p.grad is None for p in model.parameters())
