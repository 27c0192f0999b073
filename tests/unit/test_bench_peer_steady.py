"""benchmarks/peer_steady.py's arithmetic and benchmarks/peer_probe.py's schedule, with plain
values: which arm a window trains in, the per-cycle ratios, and the split of the machine's CPU by
role that bounds what peer mode costs beside the step."""

from __future__ import annotations

import pytest

from benchmarks.peer_probe import ARMS, arm_at
from benchmarks.peer_steady import beside, cores, cycle_ratios, descendants, thread_role


def test_every_arm_trains_a_block_of_each_cycle_in_a_rotating_place() -> None:
    block, warm = 5, 7
    assert arm_at(6, block=block, warm=warm) is None
    got = [arm_at(step, block=block, warm=warm) for step in range(warm, warm + 3 * 3 * block)]
    assert got[:block] == [("peer", 0)] * block
    for cycle in range(3):
        this = got[cycle * 3 * block : (cycle + 1) * 3 * block]
        assert {c for _, c in this} == {cycle}
        order = [this[k * block][0] for k in range(3)]
        assert sorted(order) == sorted(ARMS)
        assert all(this[k * block + j][0] == order[k] for k in range(3) for j in range(block))
    firsts = [got[c * 3 * block][0] for c in range(3)]
    assert sorted(firsts) == sorted(ARMS)  # each arm goes first once in three cycles


def test_a_cycle_ratio_is_of_the_blocks_medians_and_an_incomplete_cycle_is_left_out() -> None:
    windows = [
        ["peer", 0, 0.021, 0.010], ["peer", 0, 0.500, 0.011], ["peer", 0, 0.021, 0.012],
        ["restart", 0, 0.020, 0.010], ["restart", 0, 0.020, 0.010], ["restart", 0, 0.020, 0.010],
        ["control", 0, 0.019, 0.010], ["control", 0, 0.020, 0.010], ["control", 0, 0.021, 0.010],
        ["peer", 1, 0.030, 0.010], ["restart", 1, 0.030, 0.010],
    ]  # fmt: skip
    ((peer, control),) = cycle_ratios(windows)  # samples/s: a longer window is a lower rate
    assert peer == pytest.approx(20 / 21) and control == pytest.approx(1.0)  # the 0.5 s save is a median away
    ((peer_cpu, _),) = cycle_ratios(windows, column=3)
    assert peer_cpu == pytest.approx(10 / 11)


def test_the_control_plane_is_the_service_and_what_it_started() -> None:
    procs = {
        "1": {"ppid": 0}, "10": {"ppid": 1}, "11": {"ppid": 10}, "12": {"ppid": 11},
        "13": {"ppid": 12}, "20": {"ppid": 1},
    }  # fmt: skip
    assert descendants(procs, 10) == {10, 11, 12, 13}
    assert descendants(procs, 20) == {20}


def test_threads_get_their_roles() -> None:
    assert thread_role("main") == "training thread"
    assert thread_role("native:python") == "native"
    assert thread_role("elastrain-data") == "data thread"
    assert thread_role("elastrain-lifeline") == "thread elastrain-lifeline"


def _mark(wall: float, threads: dict[str, tuple[str, int]], procs: dict[str, tuple[int, int]]) -> dict:
    return {
        "wall": wall,
        "threads": {tid: {"name": n, "ticks": t} for tid, (n, t) in threads.items()},
        "processes": {pid: {"name": "x", "ppid": pp, "ticks": t} for pid, (pp, t) in procs.items()},
    }


def test_cpu_is_split_by_role_between_the_marks() -> None:
    """Two ranks (pids 100, 200) under agents 50, 60, under the service 10 with its etcd 11; a
    process elsewhere (300). 1 tick = 10 ms, 2 s between the marks."""
    procs_a = {"10": (1, 100), "11": (10, 500), "50": (10, 10), "60": (10, 20), "100": (50, 0),
               "200": (60, 0), "300": (1, 7)}  # fmt: skip
    procs_b = {"10": (1, 104), "11": (10, 510), "50": (10, 12), "60": (10, 22), "100": (50, 300),
               "200": (60, 300), "300": (1, 9), "400": (10, 3)}  # fmt: skip
    zero = {"rank": 0, "pid": 100, "ppid": 50, "marks": [
        _mark(0.0, {"100": ("main", 0), "101": ("elastrain-lifeline", 1)}, procs_a),
        _mark(2.0, {"100": ("main", 150), "101": ("elastrain-lifeline", 3), "102": ("native:gloo", 20)},
              procs_b),
    ]}  # fmt: skip
    one = {"rank": 1, "pid": 200, "ppid": 60, "marks": [
        _mark(5.0, {"200": ("main", 10)}, {}), _mark(7.0, {"200": ("main", 150)}, {}),
    ]}  # fmt: skip
    got = cores([zero, one], service_pid=10, tick=0.01)
    assert got["training thread"] == pytest.approx((150 + 140) * 0.01 / 2.0)
    assert got["native"] == pytest.approx(0.1)
    assert got["thread elastrain-lifeline"] == pytest.approx(0.01)
    assert got["agents"] == pytest.approx(0.02)
    assert got["control plane"] == pytest.approx((4 + 10 + 3) * 0.01 / 2.0)  # a new child counts from 0
    assert got["rest of the machine"] == pytest.approx(0.01)
    assert beside(got) == pytest.approx(0.01 + 0.02 + 0.085)
