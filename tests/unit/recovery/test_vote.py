"""The commit vote: every member reads the same verdict from the summed ballots, a non-finite
gradient is never lost, and a member at another generation or version is fenced on every member,
the one ahead included."""

from __future__ import annotations

import itertools
import math

import pytest

from worker.recovery.failure import classify
from worker.recovery.vote import Fenced, Verdict, check, contribution, reduce_sum, stamps


def ballots(*stamps_: tuple[int, int], reform: tuple[bool, ...] = ()) -> list[list[float]]:
    world = len(stamps_)
    asks = reform or (False,) * world
    return [
        contribution(reform=asks[r], generation=g, version=v, rank=r, world_size=world)
        for r, (g, v) in enumerate(stamps_)
    ]


def verdicts(votes: list[list[float]], mine: list[tuple[int, int]], nonfinite: bool = False) -> list[Verdict]:
    summed = reduce_sum(votes)
    return [check(summed, nonfinite=nonfinite, generation=g, version=v) for g, v in mine]


@pytest.mark.parametrize(
    ("reform", "nonfinite", "expected"),
    [
        ((False, False, False), False, Verdict(False, False)),
        ((False, False, False), True, Verdict(True, False)),
        ((True, False, False), False, Verdict(False, True)),
        ((True, False, False), True, Verdict(True, True)),  # both seen by all: no request hidden
    ],
)
def test_every_member_reads_the_same_verdict(
    reform: tuple[bool, ...], nonfinite: bool, expected: Verdict
) -> None:
    at = [(3, 41)] * 3
    assert verdicts(ballots(*at, reform=reform), at, nonfinite) == [expected] * 3


def test_every_member_reads_every_stamp_exactly_at_the_largest_values() -> None:
    big = ((1 << 29) - 1, (1 << 32) - 1)
    summed = reduce_sum(ballots(big, (0, 0), (7, 123)))
    assert stamps(summed, 3) == [big, (0, 0), (7, 123)]


def test_a_nonfinite_flag_is_never_lost_in_any_order() -> None:
    """The flag is the step's own summed element (NaN from any rank); the vote passes it on."""
    for combo in itertools.product([0.0, math.nan], repeat=3):
        found = not math.isfinite(math.fsum(combo))
        (verdict,) = verdicts(ballots((1, 5)), [(1, 5)], nonfinite=found)
        assert verdict.nonfinite == any(math.isnan(c) for c in combo)


@pytest.mark.parametrize(
    "other",
    [
        (3, 40),  # one member behind
        (3, 42),  # one member ahead
        (2, 41),  # a stalled member of an older generation
        (4, 41),
        (2, 50),
    ],
)
def test_a_different_stamp_fences_every_member(other: tuple[int, int]) -> None:
    at = [(3, 41), (3, 41), other]
    summed = reduce_sum(ballots(*at))
    for g, v in at:
        with pytest.raises(Fenced) as info:
            check(summed, nonfinite=False, generation=g, version=v)
        assert "fenced" in str(info.value) and info.value.seen == tuple(at)
        assert classify(info.value).kind == "fenced"


def test_a_different_stamp_fences_even_when_a_member_is_nonfinite() -> None:
    summed = reduce_sum(ballots((3, 41), (3, 40)))
    with pytest.raises(Fenced):
        check(summed, nonfinite=True, generation=3, version=41)


def test_an_empty_slot_fences() -> None:
    """Two members that both believe they are rank 0: rank 1's slot is empty, rank 0's doubled."""
    one = contribution(reform=False, generation=3, version=41, rank=0, world_size=2)
    summed = reduce_sum([one, one])
    with pytest.raises(Fenced, match="an empty slot"):
        check(summed, nonfinite=False, generation=3, version=41)


def test_limits_are_refused() -> None:
    for bad in [{"generation": -1, "version": 0}, {"generation": 1 << 29, "version": 0},
                {"generation": 0, "version": 1 << 32}]:  # fmt: skip
        with pytest.raises(ValueError, match="outside"):
            contribution(reform=False, rank=0, world_size=1, **bad)
    with pytest.raises(ValueError, match="rank 2"):
        contribution(reform=False, generation=0, version=0, rank=2, world_size=2)
