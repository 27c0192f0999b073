"""The benchmarks' arithmetic (benchmarks/stats.py): what decides whether a printed ratio meets
its target, with plain values."""

from __future__ import annotations

import math
import random

import pytest

from benchmarks.stats import geomean_interval, rotation, spread, verdict


def test_the_spread_is_the_median_and_the_range() -> None:
    assert spread([3.0, 1.0, 2.0]) == "median 2.00 (min 1.00, max 3.00)"
    assert spread([1234.5, 9999.0, 10.0], 0, grouping=True) == "median 1,234 (min 10, max 9,999)"


def test_every_arm_takes_every_place_in_turn() -> None:
    arms = ("restart", "peer", "control")
    orders = [rotation(arms, i) for i in range(3)]
    assert orders[0] == arms and rotation(arms, 3) == arms
    for place in range(3):
        assert {order[place] for order in orders} == set(arms)
    assert [rotation(("restart", "peer"), i) for i in range(2)] == [("restart", "peer"), ("peer", "restart")]


def test_the_interval_is_about_the_geometric_mean_and_narrows_with_rounds() -> None:
    """A ratio and its inverse cancel; equal rounds give a point; noisy rounds around 1 give an
    interval that holds 1 and narrows as rounds are added (the rounds drawn, seeded)."""
    assert geomean_interval([2.0, 0.5]) == (pytest.approx(1.0), pytest.approx(0.5), pytest.approx(2.0))
    assert geomean_interval([1.01] * 5) == pytest.approx((1.01, 1.01, 1.01))
    noise = random.Random(7)
    few = [math.exp(noise.gauss(0.0, 0.08)) for _ in range(6)]
    many = few + [math.exp(noise.gauss(0.0, 0.08)) for _ in range(60)]
    _, lo6, hi6 = geomean_interval(few)
    _, lo66, hi66 = geomean_interval(many)
    assert lo6 < 1.0 < hi6 and lo66 < 1.0 < hi66
    assert hi66 - lo66 < hi6 - lo6
    assert geomean_interval(few) == geomean_interval(few)  # seeded: the printout is reproducible


def test_a_target_is_met_only_when_the_whole_interval_clears_it() -> None:
    assert verdict((1.01, 0.985, 1.03), 0.98) == "met"
    assert verdict((0.95, 0.93, 0.975), 0.98) == "missed"
    assert verdict((1.00, 0.96, 1.04), 0.98).startswith("not settled")
    # an upper bound (the join's longest step against its bound): the interval's top decides
    assert verdict((0.94, 0.92, 0.98), 1.0, at_most=True) == "met"
    assert verdict((1.05, 1.01, 1.09), 1.0, at_most=True) == "missed"
    assert verdict((0.98, 0.96, 1.01), 1.0, at_most=True).startswith("not settled")


def test_ratios_that_are_no_ratios_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        geomean_interval([])
    with pytest.raises(ValueError, match="positive"):
        geomean_interval([1.0, 0.0])
