"""The schedule of the two-process benchmark loops (benchmarks/alternating.py): blocks of
iterations, every arm once a cycle, the order rotating so that no arm always follows another."""

from __future__ import annotations

import itertools

from benchmarks.alternating import blocks


def test_each_cycle_runs_every_arm_in_one_block_and_the_order_rotates() -> None:
    arms = ("a", "b", "c")
    schedule = list(blocks(arms, iterations=3 * 3 * 4, block=4))
    assert len(schedule) == 36
    orders = []
    for cycle, group in itertools.groupby(schedule, key=lambda ca: ca[0]):
        runs = [(arm, len(list(g))) for arm, g in itertools.groupby(a for _, a in group)]
        assert sorted(arm for arm, _ in runs) == list(arms) and {n for _, n in runs} == {4}, (cycle, runs)
        orders.append(tuple(arm for arm, _ in runs))
    assert len(set(orders)) == 3, orders
    assert {order[0] for order in orders} == set(arms), "each arm leads a cycle in turn"
