"""A SIGTERM is a request to stop at the next step boundary, carried on the step's own
all-reduce: the request survives the sum and leaves the non-finite flag as it was, a step with a
request still applies, and a non-finite window loses the request (it is made again)."""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

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


def test_while_the_group_re_forms_a_stop_signal_from_a_tearing_down_agent_exits_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """torchrun's agent sends SIGTERM to the workers it still has when one of its node failed: a
    peer-mode member re-forming then leaves at once (no wait for the agent's SIGKILL). A loss on
    another node leaves the signal a request, for the re-formed group's first step to carry."""
    exits: list[int] = []
    request = preemption.StopRequest(exit=exits.append, torn_down=lambda: True)
    with request.leaving_at_once():
        request.handle(signal.SIGTERM)
    assert exits == [preemption.EXIT_PREEMPTED]
    assert "a worker of this node is gone" in capsys.readouterr().err
    request = preemption.StopRequest(exit=exits.append, torn_down=lambda: True)
    request.handle(signal.SIGTERM)  # the request, during training
    assert exits == [preemption.EXIT_PREEMPTED] and request.requested and not request.at_once
    with request.leaving_at_once():  # a re-formation that starts after it: leaves on entering
        pass
    assert exits == [preemption.EXIT_PREEMPTED] * 2
    elsewhere = preemption.StopRequest(exit=exits.append, torn_down=lambda: False)
    with elsewhere.leaving_at_once():
        elsewhere.handle(signal.SIGTERM)
    assert exits == [preemption.EXIT_PREEMPTED] * 2 and elsewhere.requested


def test_a_local_peer_is_lost_when_fewer_of_the_agents_children_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = os.getppid()
    (tmp_path / str(parent) / "task" / str(parent)).mkdir(parents=True)
    children = tmp_path / str(parent) / "task" / str(parent) / "children"
    for pid, state in ((11, "S"), (12, "Z"), (13, "R")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (python) {state} {parent} 1 1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    children.write_text("11 13 ")
    assert not preemption.local_peer_lost(str(tmp_path))
    children.write_text("11 12 ")  # the other worker exited; the agent has not reaped it yet
    assert preemption.local_peer_lost(str(tmp_path))
    children.write_text("11 ")
    assert preemption.local_peer_lost(str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not preemption.local_peer_lost(str(tmp_path))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not preemption.local_peer_lost(str(tmp_path / "none"))  # unreadable: no claim
