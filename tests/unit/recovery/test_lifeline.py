"""The lifeline's decisions without a process: when to install it, and the watchdog's rule
(the real agent kill is tests/integration/recovery/test_lifeline.py)."""

from __future__ import annotations

import itertools
import os
import select
import threading
import time

import pytest

from worker.start import lifeline
from worker.start.lifeline import Sight, dying, on_last_words, say_last_words, should_install, watch


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


def test_the_stat_line_says_a_process_is_dying_the_moment_it_is_killed() -> None:
    """A SIGKILL is pending in the stat line before the killed process has run at all; then its
    exit sets PF_EXITING (it stays in state R while the kernel frees its memory), then it is a
    zombie. A command name with spaces and parentheses does not shift the fields."""
    line = (
        b"2266 (cat) R 2264 2264 1206 0 -1 4194304 100 0 0 0 0 0 0 0 20 0 1 0 189802 3133440 388 "
        b"0 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 0"
    )
    assert dying(line) is None  # a real line of a running `cat`
    assert dying(line.replace(b"(cat)", b"(a) R 1 (b)")) is None
    fields = line.split()
    killed = b" ".join([*fields[:30], b"256", *fields[31:]])  # field 31: SIGKILL is bit 9
    assert dying(killed) == "was sent SIGKILL"
    assert dying(b" ".join([*fields[:30], b"2", *fields[31:]])) is None  # a pending SIGINT lives on
    exiting = b" ".join([*fields[:8], str(4194304 | 0x4).encode(), *fields[9:]])
    assert dying(exiting) == "is exiting"
    assert dying(line.replace(b") R ", b") Z ")) == "is exiting"


def test_the_last_words_carry_the_middle_of_the_last_live_look_and_the_first_dying_one() -> None:
    """Looks at t=1, 2, 3 find the agent alive, the look begun at t=4 finds it killed and ends at
    t=5: it died after 3 and by 5, and the last words say 4, the middle (at most half the gap
    off; 3 alone would be early by up to the whole gap)."""
    looks = iter([None, None, None, "was sent SIGKILL"])
    clock = iter([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).__next__
    said: list[float] = []
    seen: list[str] = []
    forget = on_last_words(said.append)
    try:
        sight = Sight(lambda: next(looks), clock=clock)
        watch(100, poll_s=3600.0, look_s=0.001, getppid=lambda: 100, on_orphan=seen.append, sight=sight)
    finally:
        forget()
    assert said == [4.0] and seen == ["its agent (pid 100) was sent SIGKILL"]
    assert (sight.alive_at, sight.dying_at) == (3.0, 5.0)


def test_an_exit_the_pidfd_told_first_is_bracketed_by_a_look_after_it() -> None:
    """The agent exited between two looks (on a loaded machine the pidfd wakes the thread before
    any look found a SIGKILL pending): the thread looks once more, which finds it gone and closes
    the bracket with its own time."""
    readable, writable = os.pipe()
    os.write(writable, b"x")  # the agent has exited
    looks = iter(["is gone"])
    clock = iter([0.0, 1.0, 2.0]).__next__
    said: list[float] = []
    forget = on_last_words(said.append)
    try:
        sight = Sight(lambda: next(looks), clock=clock)
        watch(100, poll_s=3600.0, getppid=lambda: 100, on_orphan=lambda _: None, pidfd=readable, sight=sight)
    finally:
        forget()
        os.close(readable)
        os.close(writable)
    assert (sight.alive_at, sight.dying_at) == (0.0, 2.0)
    assert said == [1.0]


def test_the_death_is_the_middle_of_what_the_looks_bracket() -> None:
    """Pure: the middle of the last live look and the first dying one; a sight of death no later
    than the last live look (clocks stepped back) is the live look itself."""
    assert lifeline.died_between(10.0, 10.08) == pytest.approx(10.04)
    assert lifeline.died_between(10.0, 10.0) == 10.0
    assert lifeline.died_between(10.0, 9.9) == 10.0


def test_without_a_dying_look_the_death_is_bracketed_by_when_it_was_seen() -> None:
    """The pidfd (or getppid) told before any look found the agent dying: the time it was seen
    closes the bracket."""
    clock = iter([0.0, 2.0]).__next__
    sight = Sight(lambda: None, clock=clock)
    assert sight.look() is None and sight.alive_at == 2.0
    assert sight.death(now=3.0) == 2.5


def test_asking_for_last_words_wakes_the_thread_to_look_at_the_faster_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without a listener the thread looks once a second (poll_s); peer mode registers its last
    words after the lifeline is armed, and the thread, asleep for up to that second, is woken to
    take up LOOK_S at once."""
    sight = Sight(lambda: None)
    monkeypatch.setattr(lifeline, "_sight", sight)
    woken = select.poll()
    woken.register(sight.woken, select.POLLIN)
    assert woken.poll(0) == []
    forget = on_last_words(lambda when: None)
    try:
        assert woken.poll(0) != []
    finally:
        forget()


def test_the_thread_sleeps_longer_while_the_training_thread_glances() -> None:
    """Without last words wanted: once a second. With them: 10 ms looks while nobody else looks
    (a spare, a save, a stalled step), 50 ms while the training thread glanced within 50 ms."""
    rule = {"look_s": 0.01, "glanced_s": 0.05, "poll_s": 1.0}
    assert lifeline.period(now=10.0, glanced_at=9.99, wanted=False, **rule) == 1.0
    assert lifeline.period(now=10.0, glanced_at=9.99, wanted=True, **rule) == 0.05
    assert lifeline.period(now=10.0, glanced_at=9.96, wanted=True, **rule) == 0.05
    assert lifeline.period(now=10.0, glanced_at=9.93, wanted=True, **rule) == 0.01
    assert lifeline.period(now=10.0, glanced_at=float("-inf"), wanted=True, **rule) == 0.01
    assert lifeline.period(now=10.0, glanced_at=9.99, wanted=True, **rule | {"poll_s": 0.02}) == 0.02


def test_a_glance_keeps_the_sign_of_life_fresh_and_a_dying_agent_wakes_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The training thread's glances stamp the last sign of life as the thread's looks do; one
    that finds the agent killed leaves the stamp at the last live look and wakes the thread
    (which looks again and says the last words). Nothing is looked at while no last words are
    wanted."""
    looks = iter([None, "was sent SIGKILL"])
    looked: list[int] = []

    def look() -> str | None:
        looked.append(1)
        return next(looks)

    clock = iter([0.0, 1.0, 2.0, 2.5]).__next__
    sight = Sight(look, clock=clock)
    monkeypatch.setattr(lifeline, "_sight", sight)
    woken = select.poll()
    woken.register(sight.woken, select.POLLIN)
    lifeline.glance()
    assert looked == [] and sight.glanced_at == float("-inf")  # no listener: no look
    forget = on_last_words(lambda when: None)
    try:
        os.read(sight.woken, 64)  # asking for last words woke the thread; start from quiet
        before = time.monotonic()
        lifeline.glance()  # looks at t=1: alive
        glanced = sight.glanced_at
        assert sight.alive_at == 1.0 and before <= glanced <= time.monotonic() and woken.poll(0) == []
        lifeline.glance()  # within GLANCE_S of the last look: none
        assert len(looked) == 1 and sight.glanced_at == glanced
        sight.glanced_at = glanced = glanced - lifeline.GLANCE_S  # as if GLANCE_S had passed
        lifeline.glance()  # looks at t=2: killed
        assert sight.alive_at == 1.0 and sight.glanced_at == glanced and woken.poll(0) != []
        assert sight.dying_at == 2.5  # stamped after the look that found it killed
    finally:
        forget()


def test_a_failpoint_nap_glances_while_last_words_are_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    looked: list[float] = []
    sight = Sight(lambda: looked.append(time.monotonic()))  # type: ignore[func-returns-value]
    monkeypatch.setattr(lifeline, "_sight", sight)
    lifeline.nap(0.05)
    assert looked == []
    forget = on_last_words(lambda when: None)
    try:
        lifeline.nap(0.1)
    finally:
        forget()
    assert len(looked) >= 3 and max(b - a for a, b in itertools.pairwise(looked)) < 0.04, looked


def test_micro_batches_glance_only_while_last_words_are_wanted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restart mode's micro-batches come as they are (no generator added to the hot path); peer
    mode's are each preceded by a glance, which looks at the agent when GLANCE_S has passed since
    the last look (here the batches come GLANCE_S apart)."""
    looked: list[int] = []
    sight = Sight(lambda: looked.append(1))  # type: ignore[func-returns-value]
    monkeypatch.setattr(lifeline, "_sight", sight)
    batches = iter([1, 2, 3])
    assert lifeline.glancing(batches) is batches
    forget = on_last_words(lambda when: None)
    try:
        seen = []
        for batch in lifeline.glancing(iter([1, 2, 3])):
            seen.append((batch, len(looked)))
            time.sleep(lifeline.GLANCE_S)
    finally:
        forget()
    assert seen == [(1, 1), (2, 2), (3, 3)]
