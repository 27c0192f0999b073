"""The commit vote: every member reads the same verdict from the reduced vote, a non-finite
gradient is never lost, and a member at another generation or version is fenced on every member,
the one ahead included."""

from __future__ import annotations

import itertools

import pytest

from worker.recovery.failure import classify
from worker.recovery.vote import Fenced, Verdict, check, pack, reduce_max, split_stamp, stamp, unpack


def member(
    nonfinite: bool = False, reform: bool = False, generation: int = 3, version: int = 41
) -> tuple[int, int]:
    return pack(nonfinite=nonfinite, reform=reform, generation=generation, version=version)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([(False, False)] * 3, Verdict(False, False)),
        ([(True, False), (False, False), (False, False)], Verdict(True, False)),
        ([(False, True), (False, False), (False, False)], Verdict(False, True)),
        ([(True, True), (False, False)], Verdict(True, True)),  # the leader itself non-finite
        ([(False, True), (True, False)], Verdict(True, False)),  # hidden from all alike: asked again
        ([(True, False), (True, False)], Verdict(True, False)),
    ],
)
def test_every_member_reads_the_same_verdict(flags: list[tuple[bool, bool]], expected: Verdict) -> None:
    votes = [member(n, r) for n, r in flags]
    reduced = reduce_max(votes)
    assert [check(reduced, mine) for mine in votes] == [expected] * len(votes)


def test_nonfinite_is_never_lost_in_any_order() -> None:
    for combo in itertools.product([False, True], repeat=3):
        votes = [member(nonfinite=n) for n in combo]
        assert check(reduce_max(votes), votes[0]).nonfinite == any(combo)


@pytest.mark.parametrize(
    "other",
    [
        {"version": 40},  # one member behind
        {"version": 42},  # one member ahead
        {"generation": 2},  # a stalled member of an older generation
        {"generation": 4},
        {"generation": 2, "version": 50},
    ],
)
def test_a_different_stamp_fences_every_member(other: dict[str, int]) -> None:
    votes = [member(), member(), member(**other)]
    reduced = reduce_max(votes)
    for mine in votes:
        with pytest.raises(Fenced) as info:
            check(reduced, mine)
        assert "fenced" in str(info.value)
        assert classify(info.value).kind == "fenced"


def test_a_different_stamp_fences_even_when_a_member_is_nonfinite() -> None:
    votes = [member(nonfinite=True), member(version=40)]
    with pytest.raises(Fenced):
        check(reduce_max(votes), votes[0])


def test_stamp_round_trip_and_limits() -> None:
    assert split_stamp(stamp(7, 123)) == (7, 123)
    flags, low, high = unpack(member(nonfinite=True, reform=True))
    assert (flags, low, high) == (3, stamp(3, 41), stamp(3, 41))
    for bad in [{"generation": -1, "version": 0}, {"generation": 1 << 29, "version": 0},
                {"generation": 0, "version": 1 << 32}]:  # fmt: skip
        with pytest.raises(ValueError, match="outside"):
            stamp(**bad)
    # The largest values still fit a signed int64 after packing.
    first, second = pack(nonfinite=True, reform=True, generation=(1 << 29) - 1, version=(1 << 32) - 1)
    assert 0 <= first < 1 << 63 and 0 <= second < 1 << 63
    first, _ = pack(nonfinite=True, reform=True, generation=0, version=0)
    assert first < 1 << 63
