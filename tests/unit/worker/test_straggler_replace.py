"""``stragglers.action: replace`` from plain values: whether the named rank's node leaves (a
spare waits, or the group may go on smaller) or stays and why; the spares on the window's vector;
the watch choosing the leave on the named node's ranks only; and the refusal without peer recovery."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.unit.worker.test_stragglers import Recorder, summed, watched_steps
from worker.jobspec.recovery import refuse_replace
from worker.jobspec.stragglers import StragglerSpec
from worker.train import preemption
from worker.train.straggler_watch import StragglerWatch
from worker.train.stragglers import Named, ballot, replacement, slowest, unpack


def named(rank: int, slowdown: float = 2.0) -> Named:
    return Named(rank=rank, slowdown=slowdown, first_step=1, step=20, windows=2)


def test_a_waiting_spare_takes_the_slow_nodes_place_with_every_rank_of_that_node() -> None:
    decision = replacement(named(3), [0, 0, 1, 1], spares=1, min_world=4)
    assert decision.leave and decision.node == 1 and decision.ranks == (2, 3)
    assert "warm spare" in decision.why


def test_without_a_spare_the_node_leaves_only_when_the_rest_stays_at_the_minimum() -> None:
    smaller = replacement(named(1), [0, 1, 2], spares=0, min_world=2)
    assert smaller.leave and "goes on with 2 ranks" in smaller.why
    kept = replacement(named(1), [0, 1], spares=0, min_world=2)
    assert not kept.leave and kept.ranks == (1,)
    assert "no spare waits" in kept.why and "below the 2" in kept.why


def test_a_node_that_is_the_whole_group_or_unknown_stays() -> None:
    assert not replacement(named(0), [0, 0], spares=3, min_world=1).leave
    assert replacement(named(1), [0, None], spares=1, min_world=1).why == "its node is not known"


def test_the_slowest_named_rank_is_the_one_replaced() -> None:
    assert slowest([named(0, 1.5), named(2, 3.0), named(1, 2.0)]) == named(2, 3.0)
    assert slowest([]) is None


def test_the_leaders_spare_count_rides_on_the_vector() -> None:
    votes = [ballot(rank=0, world_size=2, seconds_per_step=0.1, node=0, spares=2),
             ballot(rank=1, world_size=2, seconds_per_step=0.2, node=1, spares=0)]  # fmt: skip
    assert len(votes[0]) == 5
    times, nodes, spares = unpack(summed(*votes), 2)
    assert times == pytest.approx([0.1, 0.2]) and nodes == [0, 1] and spares == 2


def test_replace_is_refused_without_peer_recovery_in_one_line_naming_the_field() -> None:
    line = refuse_replace("replace", peer=False, why="recovery.mode is 'restart'")
    assert line is not None and line.startswith("field 'stragglers.action': 'replace' needs peer recovery")
    assert "\n" not in line and "set 'stragglers.action' to 'report'" in line
    assert refuse_replace("replace", peer=True, why="") is None
    assert refuse_replace("report", peer=False, why="") is None


def watch_on(node: int, spares: int | None, left: list[str]) -> tuple[StragglerWatch, Recorder, Any]:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    events = Recorder()
    spec = StragglerSpec(window_steps=5, windows=2, action="replace")
    watch = StragglerWatch(
        spec, model=model, optimizer=opt, events=events, metrics=None, node=node, active=True
    )
    watch.spares = None if spares is None else (lambda: spares)
    watch.min_world = 2
    watch.leave = left.append
    return watch, events, (model, opt)


def two_slow_windows(watch: StragglerWatch, parts: Any, *, other_node: int, other_spares: int) -> None:
    """Rank 1 (this watch) twice as slow as rank 0 in two windows of 5 steps."""
    for window in (1, 2):
        watched_steps(watch, parts[0], parts[1], 5)
        mine = watch.ballot(window * 5, rank=1, world_size=2)
        other = ballot(
            rank=0, world_size=2, seconds_per_step=mine[1] / 2, node=other_node, spares=other_spares
        )
        watch.read(summed(mine, other), window * 5, rank=1, world_size=2)


def test_the_named_nodes_ranks_leave_for_a_spare_the_leader_counted() -> None:
    left: list[str] = []
    watch, events, parts = watch_on(node=4, spares=0, left=left)  # rank 1 is not the leader: it counts 0
    two_slow_windows(watch, parts, other_node=0, other_spares=1)
    (replaced,) = [f for name, f in events.seen if name == "straggler_replaced"]
    assert replaced["rank"] == 1 and replaced["node"] == 4 and replaced["ranks"] == [1]
    assert left == [preemption.STRAGGLER]


def test_without_a_spare_and_at_the_minimum_the_straggler_stays_and_the_event_says_why() -> None:
    left: list[str] = []
    watch, events, parts = watch_on(node=4, spares=0, left=left)
    two_slow_windows(watch, parts, other_node=0, other_spares=0)
    (kept,) = [f for name, f in events.seen if name == "straggler_kept"]
    assert "no spare waits" in kept["why"] and left == []
    assert [name for name, _ in events.seen].count("straggler") == 1  # named as before


def test_outside_peer_mode_nothing_leaves() -> None:
    left: list[str] = []
    watch, events, parts = watch_on(node=4, spares=None, left=left)
    two_slow_windows(watch, parts, other_node=0, other_spares=0)
    (kept,) = [f for name, f in events.seen if name == "straggler_kept"]
    assert kept["why"] == "the job does not run in peer mode" and left == []


def test_a_node_leaving_asks_like_a_signal_and_signals_its_agent() -> None:
    request = preemption.StopRequest()
    sent: list[tuple[int, int]] = []
    saved, preemption.REQUEST = preemption.REQUEST, request
    try:
        preemption.leave_node(preemption.STRAGGLER, kill=lambda pid, sig: sent.append((pid, sig)), agent=4242)
    finally:
        preemption.REQUEST = saved
    assert request.requested and request.signal_name == "straggler"
    assert sent == [(4242, preemption.signal.SIGTERM)]


def test_a_bare_torchrun_refuses_replace(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.errors import SpecError
    from worker.main import _replace_needs_peer

    monkeypatch.delenv("ELASTRAIN_RECOVERY", raising=False)
    with pytest.raises(SpecError, match=r"^field 'stragglers\.action': 'replace' needs peer recovery"):
        _replace_needs_peer("replace")
    _replace_needs_peer("report")
    monkeypatch.setenv("ELASTRAIN_RECOVERY", "peer")
    _replace_needs_peer("replace")


def slow_window(
    watch: StragglerWatch, parts: Any, window: int, *, other_spares: int, factor: float = 2.0
) -> None:
    """One more window of 5 steps: rank 1 (this watch) ``factor`` times as slow as rank 0, whose
    leader counts ``other_spares`` spares waiting."""
    watched_steps(watch, parts[0], parts[1], 5)
    mine = watch.ballot(window * 5, rank=1, world_size=2)
    other = ballot(rank=0, world_size=2, seconds_per_step=mine[1] / factor, node=0, spares=other_spares)
    watch.read(summed(mine, other), window * 5, rank=1, world_size=2)


def said(events: Recorder, name: str) -> list[dict[str, Any]]:
    return [f for n, f in events.seen if n == name]


def test_a_kept_straggler_leaves_once_a_spare_waits_and_is_not_kept_twice() -> None:
    left: list[str] = []
    watch, events, parts = watch_on(node=4, spares=0, left=left)
    two_slow_windows(watch, parts, other_node=0, other_spares=0)  # named, no spare: kept
    slow_window(watch, parts, 3, other_spares=0)  # still slow, still no spare: nothing new said
    assert len(said(events, "straggler_kept")) == 1 and left == []
    slow_window(watch, parts, 4, other_spares=1)  # a spare stands by now: the slow node leaves
    (replaced,) = said(events, "straggler_replaced")
    assert replaced["rank"] == 1 and replaced["node"] == 4 and replaced["step"] == 20
    assert "warm spare" in replaced["why"] and left == [preemption.STRAGGLER]
    assert len(said(events, "straggler")) == 1  # named once, replaced later


def test_a_kept_straggler_that_recovered_does_not_leave_when_a_spare_comes() -> None:
    left: list[str] = []
    watch, events, parts = watch_on(node=4, spares=0, left=left)
    two_slow_windows(watch, parts, other_node=0, other_spares=0)
    slow_window(watch, parts, 3, other_spares=1, factor=1.0)  # as fast as the others again
    assert left == [] and not said(events, "straggler_replaced")
