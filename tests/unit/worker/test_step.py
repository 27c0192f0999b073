"""The optimizer step's order of operations, with a real optimizer in one process (no group):
a skipped step changes nothing (no weight decay, no moment or step count), and gradients are
unscaled before they are clipped (the clip threshold is on the true gradient's scale)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from worker.jobspec.spec import LossScaleSpec
from worker.train.amp import DynamicLossScaler
from worker.train.step import StepResult, optimizer_step


def model_with_grad(grad: list[float]) -> nn.Linear:
    model = nn.Linear(len(grad), 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    model.weight.grad = torch.tensor([grad])
    return model


def params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())


def scaler(scale: float) -> DynamicLossScaler:
    return DynamicLossScaler(LossScaleSpec(init_scale=scale), enabled=True)


def test_a_skipped_step_applies_no_weight_decay_and_leaves_the_optimizer_alone() -> None:
    model = model_with_grad([1.0, 2.0])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5)
    assert not optimizer_step(params(model), opt, scaler(4.0), lr=0.1, clip=None).skipped  # one good step
    weight = model.weight.detach().clone()
    state = {k: v.clone() for k, v in opt.state[model.weight].items()}
    model.weight.grad = torch.tensor([[float("inf"), 1.0]])
    s = scaler(4.0)
    assert optimizer_step(params(model), opt, s, lr=0.1, clip=1.0).skipped
    assert torch.equal(model.weight, weight), "a skipped step moved the weights (weight decay?)"
    assert all(torch.equal(opt.state[model.weight][k], v) for k, v in state.items()), (
        "moments or step changed"
    )
    assert model.weight.grad is None and s.scale == 2.0 and s.state.skipped_total == 1


@pytest.mark.parametrize(
    ("true_grad", "expected_update"), [([1.5, 2.0], [0.6, 0.8]), ([0.3, 0.4], [0.3, 0.4])]
)
def test_gradients_are_unscaled_before_clipping(true_grad: list[float], expected_update: list[float]) -> None:
    """Clip at norm 1 with loss scale 1024: a true gradient of norm 2.5 is clipped to norm 1, one
    of norm 0.5 is left alone. Clipping the scaled gradient first would shrink both ~1000-fold."""
    scale = 1024.0
    model = model_with_grad([g * scale for g in true_grad])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    assert not optimizer_step(params(model), opt, scaler(scale), lr=1.0, clip=1.0).skipped
    update = 1.0 - model.weight.detach()[0]
    torch.testing.assert_close(update, torch.tensor(expected_update))


def test_the_lr_given_is_the_lr_applied() -> None:
    model = model_with_grad([1.0])
    opt = torch.optim.SGD(model.parameters(), lr=123.0)
    optimizer_step(params(model), opt, scaler(1.0), lr=0.25, clip=None)
    assert opt.param_groups[0]["lr"] == 0.25 and model.weight.item() == 0.75


def test_the_loss_sum_and_votes_come_back_from_the_steps_read() -> None:
    """Without a process group the sums over ranks are this rank's own values."""
    model = model_with_grad([1.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    result = optimizer_step(
        params(model), opt, scaler(1.0), lr=0.5, clip=None, loss_sum=torch.tensor(3.25), votes=(1.0, 0.0)
    )
    assert result == StepResult(skipped=False, loss_sum=3.25, votes=(1.0, 0.0))


class FakeCommit:
    """A commit vote without a group: its ballot travels with the step's values (its first number
    added to the non-finite flag); ``decide`` gets the (here: this rank's own) summed ballot back,
    the summed flag first."""

    def __init__(self, answer: bool | None, ballot: tuple[float, ...] = (4.0, 2.0)) -> None:
        self.answer, self.asked = answer, []  # type: ignore[var-annotated]
        self.values = list(ballot)

    def ballot(self) -> list[float]:
        return self.values

    def decide(self, found: bool, summed: Sequence[float]) -> bool:
        self.asked.append((found, list(summed)))
        if self.answer is None:
            raise RuntimeError("Connection closed by peer")
        return self.answer


def test_the_commit_vote_decides_and_a_refused_vote_changes_nothing() -> None:
    """Peer mode's commit point (worker.peer.loop): the ballot rides on the step's reduction and comes
    back after the save votes; the group's verdict replaces the local flag, and a vote that raises
    (the group broke) leaves weights, moments and the scaler as they were."""
    model = model_with_grad([1.0, 2.0])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    s = scaler(4.0)
    said_nonfinite = FakeCommit(True)
    result = optimizer_step(params(model), opt, s, lr=0.1, clip=None, votes=(1.0,), commit=said_nonfinite)
    assert said_nonfinite.asked == [(False, [4.0, 2.0])] and result.votes == (1.0,)
    assert result.skipped and not opt.state, "the group said non-finite: no update"
    assert s.state.skipped_total == 1
    model.weight.grad = torch.tensor([[1.0, 2.0]])
    weight = model.weight.detach().clone()
    with pytest.raises(RuntimeError):
        optimizer_step(params(model), opt, s, lr=0.1, clip=None, commit=FakeCommit(None))
    assert torch.equal(model.weight, weight) and not opt.state and s.state.skipped_total == 1


@pytest.mark.parametrize(("grad", "first"), [(1.0, 1.0), (math.inf, math.nan)])
def test_the_ballots_first_number_is_summed_with_the_nonfinite_flag(grad: float, first: float) -> None:
    """A re-formation request rides in the flag's element (no number more than restart mode
    sends): it counts while every gradient is finite; a non-finite one makes the element NaN,
    which the vote reads as non-finite (the request is made again the next window)."""
    model = model_with_grad([grad, 2.0])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    asked = FakeCommit(False, ballot=(1.0,))
    optimizer_step(params(model), opt, scaler(4.0), lr=0.1, clip=None, commit=asked)
    ((found, summed),) = asked.asked
    assert found == math.isnan(first) and len(summed) == 1
    assert math.isnan(summed[0]) if math.isnan(first) else summed[0] == first
