"""The lifeline's decisions without a process: when to install it, and the watchdog's rule
(the real agent kill is tests/integration/recovery/test_lifeline.py)."""

from __future__ import annotations

import threading

from worker.lifeline import should_install, watch


def test_installed_only_under_a_torchrun_agent() -> None:
    assert should_install({"TORCHELASTIC_RUN_ID": "abc"})
    assert not should_install({"RANK": "0", "WORLD_SIZE": "1"})
    assert not should_install({})


def test_the_watchdog_fires_once_the_parent_changes() -> None:
    parents = iter([100, 100, 1])  # the agent dies: the process is re-parented (to init, say)
    seen: list[str] = []
    watch(100, poll_s=0.001, getppid=lambda: next(parents), on_orphan=seen.append)
    assert len(seen) == 1 and "pid 100" in seen[0] and "parent now 1" in seen[0]


def test_the_watchdog_stays_quiet_while_the_parent_lives() -> None:
    stop = threading.Event()
    seen: list[str] = []
    calls = 0

    def parent() -> int:
        nonlocal calls
        calls += 1
        if calls == 5:
            stop.set()
        return 100

    watch(100, poll_s=0.001, getppid=parent, on_orphan=seen.append, stop=stop)
    assert seen == [] and calls == 5
