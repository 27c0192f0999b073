"""Straggler decisions from plain numbers: the shared vector, each rank's slowdown, consecutive
slow windows, one name per spell; the JobSpec's ``stragglers`` field; and the watch around them
on a real (one-process) backward and optimizer step."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.unit.worker.test_spec import EXAMPLE
from worker.errors import SpecError
from worker.jobspec.spec import parse_spec
from worker.jobspec.stragglers import StragglerSpec
from worker.report.events import Events
from worker.train.straggler_watch import StragglerWatch, node_number
from worker.train.stragglers import Named, Streaks, ballot, judge, slowdowns, unpack


def summed(*ballots: tuple[float, ...]) -> list[float]:
    return [sum(column) for column in zip(*ballots, strict=True)]


def test_the_summed_ballots_give_every_rank_its_time_and_node() -> None:
    world = 3
    votes = [
        ballot(rank=r, world_size=world, seconds_per_step=t, node=n)
        for r, t, n in [(0, 0.1, 0), (1, 0.2, 0), (2, 0.3, 1)]
    ]
    times, nodes, spares = unpack(summed(*votes), world)
    assert times == pytest.approx([0.1, 0.2, 0.3])
    assert nodes == [0, 0, 1] and spares == 0  # a report-only vector carries no spares


def test_a_rank_that_sent_nothing_has_no_node_and_no_slowdown() -> None:
    times, nodes, _ = unpack([0.1, 0.0, 1.0, 0.0], 2)
    assert nodes == [0, None]
    assert slowdowns(times) == [None, None]  # rank 0 has no one to be compared with


def test_each_rank_is_compared_with_the_median_of_the_others() -> None:
    # two ranks: each against the other (the pair's median would halve the difference)
    assert slowdowns([1.0, 2.0]) == pytest.approx([0.5, 2.0])
    # four ranks: the slow one against the median of the three others (1.0)
    assert slowdowns([1.0, 1.1, 0.9, 1.5])[3] == pytest.approx(1.5)
    assert slowdowns([1.0, 1.0, 0.0])[:2] == pytest.approx([1.0, 1.0])  # a rank without a time is left out


def run(windows: Sequence[Sequence[float | None]], *, n: int = 2, threshold: float = 1.3) -> list[Named]:
    streaks, named = Streaks(), []
    for i, ratios in enumerate(windows, start=1):
        streaks, found = judge(streaks, ratios, step=10 * i, window_steps=10, threshold=threshold, windows=n)
        named.extend(found)
    return named


def test_a_rank_is_named_after_n_consecutive_slow_windows_with_its_steps() -> None:
    (named,) = run([[1.0, 1.5], [1.0, 1.6]])
    assert named == Named(rank=1, slowdown=1.6, first_step=1, step=20, windows=2)


def test_a_normal_window_between_two_slow_ones_names_no_one() -> None:
    assert run([[1.0, 1.5], [1.0, 1.2], [1.0, 1.5], [1.0, 1.3]]) == []  # 1.3 is not above 1.3


def test_a_rank_is_named_once_per_spell_and_again_after_it_cleared() -> None:
    slow, fine = [1.0, 2.0], [1.0, 1.0]
    named = run([slow, slow, slow, fine, slow, slow, fine, fine, slow, slow])
    # steps 10-30 slow: named at 20; one normal window does not clear it (still one spell);
    # two normal windows (70, 80) do: named again at 100
    assert [(n.rank, n.step, n.first_step) for n in named] == [(1, 20, 1), (1, 100, 81)]


def test_a_window_without_a_time_keeps_the_streak() -> None:
    assert [n.step for n in run([[1.0, 1.5], [None, None], [1.0, 1.5]])] == [30]


def test_one_window_is_enough_when_windows_is_1() -> None:
    assert [n.rank for n in run([[1.4, 1.0, 1.0]], n=1)] == [0]


def test_node_is_the_service_node_index_else_torchruns_node_rank() -> None:
    assert node_number({"ELASTRAIN_NODE_INDEX": "3", "GROUP_RANK": "1"}) == 3
    assert node_number({"GROUP_RANK": "2"}) == 2
    assert node_number({}) == 0


def with_stragglers(value: object) -> str:
    return json.dumps(json.loads(EXAMPLE) | {"stragglers": value})


def test_stragglers_defaults() -> None:
    spec = parse_spec(EXAMPLE).stragglers
    assert (spec.slowdown, spec.window_steps, spec.windows, spec.action) == (1.3, 50, 2, "report")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"slowdown": 1.0}, "stragglers.slowdown"),
        ({"slowdown": "fast"}, "stragglers.slowdown"),
        ({"window_steps": 0}, "stragglers.window_steps"),
        ({"windows": 0}, "stragglers.windows"),
        ({"action": "evict"}, "stragglers.action"),
        ({"slow": 2}, "stragglers.slow"),
    ],
)
def test_bad_stragglers_name_the_field(value: object, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(with_stragglers(value))
    assert words in str(err.value)


class Recorder(Events):
    def __init__(self) -> None:
        super().__init__(enabled=False, job="j", rank=0)
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.sinks.append(lambda name, fields: self.seen.append((name, fields)))


def watched_steps(watch: StragglerWatch, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> None:
    """``n`` steps of a real backward and optimizer step, timed the way the trainer times them."""
    for _ in range(n):
        started = time.perf_counter()
        model(torch.ones(4, 3)).sum().backward()
        watch.backward_done()
        opt.step()
        opt.zero_grad()
        watch.measured(started=started, data_wait=0.0, rank=1, world_size=2)


def test_the_watch_times_real_steps_shares_them_once_per_window_and_names_the_slow_rank() -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = Recorder()
    spec = StragglerSpec(window_steps=5, windows=2)
    watch = StragglerWatch(spec, model=model, optimizer=opt, events=events, metrics=None, node=4, active=True)
    for window in (1, 2):
        watched_steps(watch, model, opt, 5)
        assert watch.ballot(window * 5 - 1, rank=1, world_size=2) == ()  # not the window's last step
        mine = watch.ballot(window * 5, rank=1, world_size=2)
        assert mine[0] == 0 and mine[1] > 0 and mine[2:] == (0.0, 5.0)  # its time, its node + 1
        other = ballot(rank=0, world_size=2, seconds_per_step=mine[1] / 2, node=0)
        watch.read(summed(mine, other), window * 5, rank=1, world_size=2)
    (named,) = [fields for name, fields in events.seen if name == "straggler"]
    assert named["rank"] == 1 and named["node"] == 4 and named["slowdown"] == pytest.approx(2.0)
    assert (named["first_step"], named["step"]) == (1, 10)
    assert [name for name, _ in events.seen].count("straggler_window") == 2


def test_an_inactive_watch_sends_nothing() -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = StragglerWatch(
        StragglerSpec(window_steps=1), model=model, optimizer=opt, events=Recorder(), metrics=None, node=0,
        active=False,
    )  # fmt: skip
    watched_steps(watch, model, opt, 3)
    assert watch.ballot(3, rank=1, world_size=2) == ()
