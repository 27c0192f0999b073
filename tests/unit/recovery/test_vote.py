"""The commit vote: every member reads the same verdict from the summed ballots, a non-finite
gradient is never lost, a member at another generation or version is fenced on every member,
the one ahead included, and the stamps ride on a generation's first window and every 64th."""

from __future__ import annotations

import itertools
import math

import pytest

from worker.recovery.failure import classify
from worker.recovery.vote import (
    STAMPS_EVERY,
    Fenced,
    Verdict,
    check,
    contribution,
    reduce_sum,
    request,
    stamps,
    stamps_due,
)


def ballots(*stamps_: tuple[int, int], reform: tuple[bool, ...] = ()) -> list[list[float]]:
    world = len(stamps_)
    asks = reform or (False,) * world
    return [
        contribution(reform=asks[r], generation=g, version=v, rank=r, world_size=world)
        for r, (g, v) in enumerate(stamps_)
    ]


def verdicts(votes: list[list[float]], mine: list[tuple[int, int]], nonfinite: bool = False) -> list[Verdict]:
    """As the step reads them: element 0 summed with the non-finite flag (NaN from a member)."""
    summed = reduce_sum(votes)
    summed[0] += math.nan if nonfinite else 0.0
    return [check(summed, nonfinite=nonfinite, generation=g, version=v) for g, v in mine]


@pytest.mark.parametrize(
    ("reform", "nonfinite", "expected"),
    [
        ((False, False, False), False, Verdict(False, False)),
        ((False, False, False), True, Verdict(True, False)),
        ((True, False, False), False, Verdict(False, True)),
        # the flag's NaN hides the request, from every member alike; the leader asks again
        ((True, False, False), True, Verdict(True, False)),
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


def test_a_vote_without_stamps_counts_the_requests_and_fences_nothing() -> None:
    """Most windows: one number a member, added to the step's flag."""
    summed = reduce_sum([request(reform=False), request(reform=True), request(reform=False)])
    assert summed == [1.0]
    for g, v in [(3, 41), (2, 7)]:  # nothing to compare: the stamps were checked when due
        assert check(summed, nonfinite=False, generation=g, version=v) == Verdict(False, True)
    assert check([0.0], nonfinite=False, generation=3, version=41) == Verdict(False, False)


def test_the_stamps_ride_on_a_generations_first_window_and_every_64th() -> None:
    due = [w for w in range(3 * STAMPS_EVERY + 1) if stamps_due(w)]
    assert due == [0, STAMPS_EVERY, 2 * STAMPS_EVERY, 3 * STAMPS_EVERY] and STAMPS_EVERY == 64


def test_a_member_counts_its_ballots_by_generation_not_by_version() -> None:
    """GroupMember.ballot: the stamps on its generation's first ballot and every 64th; a new
    generation starts the count again. The count is of ballots, not of the version the stamps
    check, so members whose versions differ still send vectors of one length."""
    from worker.recovery.membership import MemoryKeyValue
    from worker.recovery.plan import Policy
    from worker.recovery.records import GenRecord
    from worker.recovery.recover import GroupMember
    from worker.recovery.seam import RecoveryConfig

    policy = Policy(min_world=1, max_world=2)
    cfg = RecoveryConfig(job_id="job", secret=b"s" * 16, spec_hash="h", policy=policy)
    member = GroupMember(cfg, kv=MemoryKeyValue())
    me = member.member_id
    member.record = GenRecord(4, ("other", me), ("h:1", "h:2"), "other", "h:1", "h:3", 2)
    lengths = [len(member.ballot(version=100 + w % 3)) for w in range(2 * STAMPS_EVERY + 1)]
    assert [w for w, n in enumerate(lengths) if n == 5] == [0, STAMPS_EVERY, 2 * STAMPS_EVERY]
    assert set(lengths) == {1, 5}
    assert member.ballot(version=9) == [0.0], "no request: this member does not lead"
    member.record = GenRecord(5, (me, "other"), ("h:2", "h:1"), "other", "h:1", "h:3", 2)
    first = member.ballot(version=9)
    assert stamps(first, 2) == [(5, 9), (-1, -1)], "the new generation's first ballot, as rank 0"
