"""The replicas' comparison: who disagrees with the majority (with two replicas, both), which
tensors differ, which part of the state each check covers, digests that see one flipped bit, and
the check's flow with the other replica's digests handed in (a periodic check judged at the next
one, a check before a save at once; a difference named and raised)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from tests.specs import raw_spec
from worker.errors import ReplicaMismatchError, SpecError
from worker.jobspec.integrity import DEFAULT_EVERY_STEPS
from worker.jobspec.spec import parse_spec
from worker.report.events import Events
from worker.train import integrity, replicas
from worker.train.replicas import compare, differing, part_at, split


@pytest.mark.parametrize(
    ("digests", "ranks"),
    [
        ([], ()),
        (["a"], ()),
        (["a", "a"], ()),
        (["a", "b"], (0, 1)),  # two replicas: neither is trusted over the other
        (["a", "a", "b"], (2,)),
        (["b", "a", "a", "a"], (0,)),
        (["a", "b", "a", "b"], (0, 1, 2, 3)),  # a tie is no majority
        (["a", "b", "c"], (0, 1, 2)),
        (["a", "b", "b", "c", "b"], (0, 3)),
    ],
)
def test_the_ranks_that_disagree_with_the_majority(digests: list[str], ranks: tuple[int, ...]) -> None:
    verdict = compare(digests)
    assert verdict.ranks == ranks
    assert verdict.agree == (not ranks)


def test_the_tensors_that_differ_on_any_rank() -> None:
    names = ["w", "b", "optimizer.w.exp_avg"]
    assert differing(names, [[1, 2, 3], [1, 2, 3], [1, 2, 3]]) == []
    assert differing(names, [[1, 2, 3], [1, 9, 3], [1, 2, 3]]) == ["b"]
    assert differing(names, [[1, 2, 3], [7, 2, 8]]) == ["w", "optimizer.w.exp_avg"]


def test_the_parts_cover_every_tensor_once_balanced_by_bytes() -> None:
    sizes = [400, 10, 300, 300, 20, 100, 5]
    parts = split(sizes, 4)
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
    assert [sum(sizes[i] for i in p) for p in parts] == [400, 300, 300, 135]
    assert split(sizes, 4) == parts  # the same on every rank
    assert split([8, 8], 4) == [[0], [1]]  # fewer tensors than parts: no empty part
    assert split([], 4) == []
    with pytest.raises(ValueError, match="at least 1"):
        split([1], 0)


def test_each_periodic_check_takes_the_next_part() -> None:
    every = 10
    steps = [every * k for k in range(1, 9)]
    assert [part_at(s, every, 4) for s in steps] == [1, 2, 3, 0, 1, 2, 3, 0]
    assert [replicas.due(s, every) for s in (0, 5, 10, 20)] == [False, False, True, True]


def test_the_line_names_the_step_the_ranks_and_the_tensors() -> None:
    line = replicas.describe(14, [0, 1], ["net.0.weight"], 2)
    assert line == "data-parallel replicas disagree after step 14: both ranks, in net.0.weight"
    assert "ranks 2" in replicas.describe(3, [2], ["a"], 4)
    assert "all 3 ranks (no majority)" in replicas.describe(3, [0, 1, 2], ["a"], 3)
    assert "and 2 more" in replicas.describe(3, [1], [f"t{i}" for i in range(10)], 3)


def _flipped(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    word = out.view(-1)[index : index + 1].view(torch.int32)
    word ^= torch.tensor((1 << bit) - (1 << 32 if bit == 31 else 0), dtype=torch.int32)
    return out


@pytest.mark.parametrize("bit", [0, 13, 22, 30, 31])
def test_one_flipped_bit_changes_the_tensor_digest_and_the_device_fold(bit: int) -> None:
    t = torch.randn(1000)
    bad = _flipped(t, 517, bit)
    assert integrity.tensor_digests([t]) == integrity.tensor_digests([t.clone()])
    assert integrity.tensor_digests([t]) != integrity.tensor_digests([bad])
    assert torch.equal(integrity._fold(t), integrity._fold(t.clone()))  # the accelerator's fold, on CPU
    assert not torch.equal(integrity._fold(t), integrity._fold(bad))


def test_the_state_is_the_parameters_then_the_optimizer_state_not_the_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    assert [n for n, _ in integrity.state_tensors(model, optimizer)] == [
        "0.bias",
        "0.weight",
        "1.bias",
        "1.weight",
    ]
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    names = [n for n, _ in integrity.state_tensors(model, optimizer)]
    assert "optimizer.0.weight.exp_avg_sq" in names and "optimizer.1.bias.step" in names
    assert not any("running" in n for n in names)


def test_integrity_fields_are_checked_naming_the_field() -> None:
    assert parse_spec(raw_spec()).integrity.every_steps == DEFAULT_EVERY_STEPS
    with pytest.raises(SpecError, match=r"integrity\.every_steps"):
        parse_spec(raw_spec(integrity={"every_steps": 0}))
    with pytest.raises(SpecError, match=r"integrity\.enabled"):
        parse_spec(raw_spec(integrity={"enabled": "yes"}))
    with pytest.raises(SpecError, match=r"integrity\.every"):
        parse_spec(raw_spec(integrity={"every": 5}))


class Peer:
    """The other replica of a group of two, as the exchange hands back its values: the same as
    this rank's, or with the per-tensor digest at ``bad`` (and so the combined one) changed from
    ``from_call`` on."""

    def __init__(self, bad: int | None = None, from_call: int = 0) -> None:
        self.bad, self.from_call, self.calls = bad, from_call, 0

    def __call__(self, values: list[int]) -> Any:
        self.calls += 1
        other = list(values)
        if self.bad is not None and self.calls > self.from_call:
            k = self.bad if len(values) > 2 else 0
            other[k] ^= 1
        return SimpleNamespace(result=lambda: [values, other])


def check_of(
    peer: Peer, events: list[tuple[str, dict[str, Any]]], *, defer: bool = True
) -> integrity.ReplicaCheck:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    sink = Events(enabled=False, job="j", rank=0)
    sink.sinks.append(lambda name, fields: events.append((name, fields)))
    return integrity.ReplicaCheck(
        model, optimizer, every_steps=10, device=torch.device("cpu"), world_size=2, events=sink,
        metrics=None, exchange=peer, defer=defer,
    )  # fmt: skip


def test_replicas_that_agree_say_nothing() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    check = check_of(Peer(), events)
    for step in (10, 20, 30):
        check.check(step, full=False)
    check.check(30, full=True)
    assert events == [] and check.pending is None


def test_a_periodic_difference_is_judged_at_the_next_check_and_names_the_tensor() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    check = check_of(Peer(bad=0, from_call=0), events)
    check.check(10, full=False)  # its digests travel in the background: no verdict yet
    assert events == [] and check.pending is not None
    with pytest.raises(ReplicaMismatchError, match="after step 10: both ranks") as raised:
        check.check(20, full=False)
    assert raised.value.ranks == (0, 1)
    [(name, fields)] = events
    covered = [n for n, _ in check._covered(10, full=False)]
    assert name == "replica_mismatch" and fields["step"] == 10 and fields["ranks"] == [0, 1]
    assert fields["tensors"] == [covered[0]] and not fields["full"]


def test_a_difference_before_a_save_is_judged_at_once() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    check = check_of(Peer(bad=5), events)
    with pytest.raises(ReplicaMismatchError, match="nothing was saved"):
        check.check(7, full=True)
    names = [n for n, _ in integrity.state_tensors(check.model, check.optimizer)]
    assert events[0][1]["tensors"] == [names[5]] and events[0][1]["full"]


def test_without_defer_a_periodic_difference_is_judged_at_once() -> None:
    """Peer mode's check: no gather is left in flight on a group that a recovery may tear down."""
    events: list[tuple[str, dict[str, Any]]] = []
    check = check_of(Peer(bad=0), events, defer=False)
    with pytest.raises(ReplicaMismatchError, match="after step 10: both ranks"):
        check.check(10, full=False)
    assert events[0][1]["step"] == 10 and not events[0][1]["full"] and check.pending is None
