"""A timed-out collective names the ranks it waited for: from two reads of the ranks' beacons,
a rank behind this one, one without a beacon and one whose beacon stopped moving (a stopped or
dead process) are named with the last step each completed; a rank waiting alongside is not."""

from __future__ import annotations

from worker.start.hangs import Absent, Report, absent, describe


def test_the_ranks_named_are_behind_missing_or_stopped() -> None:
    first = {0: Report(10, 84, 41), 1: Report(7, 83, 41), 2: Report(9, 84, 41), 3: None}
    second = {0: Report(12, 84, 41), 1: Report(9, 83, 41), 2: Report(9, 84, 41), 3: None}
    missing = absent(first, second, me=0, position=84, world_size=5)
    assert missing == [
        Absent(1, 41, "behind"),
        Absent(2, 41, "not running"),
        Absent(3, None, "no beacon"),
        Absent(4, None, "no beacon"),
    ]
    assert describe(missing[:2]) == (
        "rank 1 (last completed step 41, behind), rank 2 (last completed step 41, not running)"
    )


def test_a_rank_waiting_alongside_is_not_named() -> None:
    first, second = {1: Report(3, 84, 41)}, {1: Report(5, 84, 41)}
    assert absent(first, second, me=0, position=84, world_size=2) == []


def test_a_beacon_read_back_parses() -> None:
    assert Report.parse(b"12,84,41") == Report(12, 84, 41)
