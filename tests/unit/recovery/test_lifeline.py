"""The lifeline's decisions without a process: when to install it, and the watchdog's rule
(the real agent kill is tests/integration/recovery/test_lifeline.py)."""

from __future__ import annotations

import os
import threading
import time

from worker.lifeline import on_last_words, say_last_words, should_install, watch


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


def test_the_agents_exit_wakes_the_watcher_and_the_last_words_come_first() -> None:
    """The thread waits on a pidfd of the agent; here a pipe stands in for it (readable = the agent
    exited; the real agent kill is in tests/integration/recovery/test_lifeline.py). It wakes
    without a poll (``poll_s`` is an hour), the last words get the wake-up's time, then the
    orphan rule runs."""
    readable, writable = os.pipe()
    said: list[float] = []
    forget = on_last_words(said.append)
    seen: list[tuple[str, float]] = []
    try:
        watcher = threading.Thread(
            target=watch, args=(100,),
            kwargs={"poll_s": 3600.0, "getppid": lambda: 100, "pidfd": readable,
                    "on_orphan": lambda reason: seen.append((reason, time.time()))},
        )  # fmt: skip
        watcher.start()
        exited = time.time()
        os.write(writable, b"x")
        watcher.join(30)
        assert not watcher.is_alive(), "the agent's exit did not wake the watcher"
    finally:
        forget()
        os.close(readable)
        os.close(writable)
    ((reason, orphaned),) = seen
    assert "pid 100" in reason and "exited" in reason
    (when,) = said
    assert exited <= when <= orphaned


def test_last_words_that_hang_do_not_keep_the_orphan_alive() -> None:
    """A send to a stopped peer can block: the last words get their budget, then it goes on."""
    forget = on_last_words(lambda when: threading.Event().wait())
    try:
        speaker = threading.Thread(target=say_last_words, args=(1.0,), kwargs={"budget_s": 0.05})
        speaker.start()
        speaker.join(30)
        assert not speaker.is_alive()
    finally:
        forget()
