"""A SIGTERM is a request to stop at the next step boundary, carried on the step's own
all-reduce: the request survives the sum and leaves the non-finite flag as it was, a step with a
request still applies, and a non-finite window loses the request (it is made again)."""

from __future__ import annotations

import math
import signal

import pytest
import torch
from torch import nn

from worker.jobspec.spec import LossScaleSpec
from worker.train import preemption
from worker.train.amp import DynamicLossScaler
from worker.train.step import optimizer_step


@pytest.mark.parametrize(
    ("ranks_asking", "flag"), [(0, 0.0), (1, 0.0), (3, 0.0), (1, 1.0), (2, 5.0), (1000, 1.0)]
)
def test_the_summed_request_splits_back_into_a_stop_and_the_flag(ranks_asking: int, flag: float) -> None:
    """Element 0 summed over the ranks: each rank's ballot plus the flag (in peer mode the flag
    carries the commit vote's count of members asking to re-form)."""
    summed = sum(preemption.ballot(True) for _ in range(ranks_asking)) + flag
    assert preemption.split(summed) == (ranks_asking, flag)


def test_a_nan_window_carries_no_request() -> None:
    stop, rest = preemption.split(preemption.ballot(True) + math.nan)
    assert stop == 0 and math.isnan(rest)


def test_the_first_sigterm_is_the_request_and_later_ones_change_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    request = preemption.StopRequest()
    assert not request.requested
    request.handle(signal.SIGTERM)
    first = request.received_at
    request.handle(signal.SIGTERM)
    assert request.requested and request.signal_name == "SIGTERM"
    assert request.received_at == first and request.repeats == 1
    assert "already under way" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("asking", "world_size", "peer", "handed_off"),
    [(1, 2, True, True), (2, 2, True, False), (1, 4, True, True), (1, 2, False, False), (3, 3, False, False)],
)
def test_in_peer_mode_some_ranks_leaving_hand_off_and_all_leaving_save(
    asking: int, world_size: int, peer: bool, handed_off: bool
) -> None:
    assert preemption.hand_off(asking=asking, world_size=world_size, peer=peer) is handed_off


def _model(grad: list[float]) -> nn.Linear:
    model = nn.Linear(len(grad), 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model.weight.grad = torch.tensor([grad])
    return model


def test_a_step_with_a_request_applies_and_says_stop() -> None:
    model, reference = _model([1.0, 2.0]), _model([1.0, 2.0])
    scaler = DynamicLossScaler(LossScaleSpec(init_scale=4.0), enabled=True)
    result = optimizer_step(
        list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1), scaler, lr=0.1, clip=None,
        stop=True,
    )  # fmt: skip
    plain = optimizer_step(
        list(reference.parameters()), torch.optim.SGD(reference.parameters(), lr=0.1),
        DynamicLossScaler(LossScaleSpec(init_scale=4.0), enabled=True), lr=0.1, clip=None,
    )  # fmt: skip
    assert result.stop == 1 and not result.skipped and plain.stop == 0
    assert torch.equal(model.weight, reference.weight), "the request changed the step"


def test_a_non_finite_window_skips_and_loses_the_request() -> None:
    model = _model([math.inf, 1.0])
    scaler = DynamicLossScaler(LossScaleSpec(init_scale=4.0), enabled=True)
    result = optimizer_step(
        list(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.1), scaler, lr=0.1, clip=None,
        stop=True,
    )  # fmt: skip
    assert result.skipped and not result.stop


def test_while_the_group_is_broken_a_stop_signal_exits_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    """torchrun's agent sends SIGTERM to the workers it still has when one failed: a peer-mode
    member re-forming has no step to carry a request, so it leaves at once (no 30 s wait for the
    agent's SIGKILL); outside a re-formation the signal stays a request."""
    exits: list[int] = []
    request = preemption.StopRequest(exit=exits.append)
    with request.leaving_at_once():
        request.handle(signal.SIGTERM)
    assert exits == [preemption.EXIT_PREEMPTED]
    assert "SIGTERM while the group re-forms" in capsys.readouterr().err
    request = preemption.StopRequest(exit=exits.append)
    request.handle(signal.SIGTERM)  # the request, during training
    assert exits == [preemption.EXIT_PREEMPTED] and request.requested and not request.at_once
    with request.leaving_at_once():  # a re-formation that starts after it: leaves on entering
        pass
    assert exits == [preemption.EXIT_PREEMPTED] * 2
