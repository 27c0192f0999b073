"""A worker dies with its torchrun agent instead of training on as an orphan.

torchrun starts its workers in new sessions (``start_new_session=True``), so a SIGKILLed agent
leaves them running: the issue's orphan kept training with the survivors for 40 steps
(measured: still alive 5 s after its agent's death without these guards). Two guards, in both recovery
modes:

* Linux: a daemon thread waits on a pidfd of the agent (``os.pidfd_open``), which the kernel
  makes readable once the agent has exited -- the same moment it would send a parent-death
  signal. That is late: the kernel first tears the agent's memory down (measured 44 ms after the
  SIGKILL on a loaded CI machine, 87 ms for a 3 GiB process here). So the agent is also looked
  at in ``/proc/<agent>/stat`` (one 3 us read of a descriptor kept open): a pending SIGKILL shows
  there the moment ``kill()`` returns, and ``PF_EXITING`` once the agent begins to exit,
  whatever killed it. The agent died between the last look that found it alive (its last sign
  of life) and the first that found it dying; the middle of the two (:func:`died_between`) is
  what the lifeline gives to its last words (:func:`on_last_words`: peer mode tells the group "my
  node died at T" over its control connections, so the incident is timed from the failure, not
  from this process's own end tens of milliseconds later); they get at most ``LAST_WORDS_S``,
  then the process SIGKILLs itself. The middle, not the last live look: that look is early by up
  to the whole gap between two looks, the middle is off by at most half of it (a CI machine
  under load went 36 ms without a look before the kill, a tenth of the recovery it timed).
  Where pidfds are missing (Linux < 5.3): ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` instead -- the
  kernel kills this process when the thread that forked it exits (torchrun forks from its main
  thread), without last words.

  Who looks, and how often. That time is as uncertain as the gap between two looks, so while
  last words are wanted the agent is looked at every ~10 ms -- but a thread's wake-up is dear on
  these VMs (~160 us of CPU with the GIL under load, measured: 1.6% of a core at 100 a second;
  what that takes from a 2-rank DDP training was below the ~3% an interleaved A/B in one run
  can show here). So the training thread looks itself, between micro-batches and after each
  optimizer step (:func:`glance`: no wake-up; ~5 us on a warm cache, ~35 us between two steps),
  at most every ``GLANCE_S`` (a short window looks once), and the thread looks every ``LOOK_S``
  only while no glance came for ``GLANCED_S``; while they come it sleeps ``GLANCED_S``
  (:func:`period`). A glance that finds the agent dying wakes the thread, which does the rest.
  A failpoint's ``sleep`` stands for a step's work and glances every ``GLANCE_S`` (:func:`nap`).
  Without last words wanted the thread looks once a second.
* Everywhere: the same thread compares ``getppid()`` with the agent's pid at each wake-up (at
  least once a second) and stops this process when it changed; ``getppid()`` is also checked
  right after arming, since the agent may have died before (measured: gone 8-26 ms after the
  agent with the signal).

Install it only in a process a torchrun agent started (:func:`should_install`): under a plain
``python -m worker`` the parent is a shell, and a worker need not die with its shell.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
PR_SET_PDEATHSIG = 1
LAST_WORDS_S = 0.2  # what the last words may take before the process stops regardless
LOOK_S = 0.01  # the gap between looks at /proc/<agent>/stat while last words are wanted
GLANCE_S = 0.02  # the least gap between two of the training thread's looks (see Sight.glance)
GLANCED_S = 0.05  # the thread's period while the training thread glances (see the module)
PF_EXITING = 0x4  # include/linux/sched.h: the task has begun to exit
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in the stat line's bitmap of pending signals

_last_words: list[Callable[[float], None]] = []
_last_words_lock = threading.Lock()
_sight: Sight | None = None  # what install()'s thread looks with


@dataclass(frozen=True, slots=True)
class Lifeline:
    """What was installed: the parent watched, and which kernel guard took (a pidfd watched by
    the thread, or the parent-death signal)."""

    parent: int
    pidfd: bool
    pdeathsig: bool
    watchdog: threading.Thread


def on_last_words(say: Callable[[float], None]) -> Callable[[], None]:
    """``say(when)`` runs once the agent is found dead at ``when`` (a time.time()), before this
    process stops; it must be quick and thread-safe. Returns the function that takes it back."""
    with _last_words_lock:
        _last_words.append(say)
    if _sight is not None:
        _sight.wake()  # the thread looks every LOOK_S from now on

    def forget() -> None:
        with _last_words_lock, contextlib.suppress(ValueError):
            _last_words.remove(say)

    return forget


def say_last_words(when: float, *, budget_s: float = LAST_WORDS_S) -> None:
    """Run every registered ``say(when)`` on a thread of their own, waiting at most ``budget_s``
    (a send to a stopped peer must not keep an orphan alive); their errors are swallowed."""
    with _last_words_lock:
        sayers = list(_last_words)
    if not sayers:
        return

    def run() -> None:
        for say in sayers:
            with contextlib.suppress(Exception):
                say(when)

    speaker = threading.Thread(target=run, name="elastrain-last-words", daemon=True)
    speaker.start()
    speaker.join(budget_s)


def should_install(env: Mapping[str, str]) -> bool:
    """True in a process started by a torchrun agent."""
    return "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_AGENT_STORE" in env


def _die(reason: str) -> None:
    sys.stderr.write(f"elastrain lifeline: {reason}; this worker stops now (pid {os.getpid()})\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return bool(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0)


def _pidfd(parent: int) -> int | None:
    """A pidfd of ``parent``, or None where the kernel or Python has none. Raises
    ProcessLookupError when ``parent`` is already gone."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(parent))
    except ProcessLookupError:
        raise
    except OSError:  # ENOSYS (Linux < 5.3), EPERM in some sandboxes
        return None


def dying(stat: bytes) -> str | None:
    """Why a process is dying or dead, from its ``/proc/<pid>/stat`` line: a SIGKILL pending (the
    kernel sets it on every thread before ``kill()`` returns), the exit begun (``PF_EXITING``), a
    zombie or dead state; None while it lives. The command name may hold spaces and parentheses:
    the fields are counted from the last ``)``."""
    fields = stat[stat.rindex(b")") + 2 :].split()
    state, flags, pending = fields[0], int(fields[6]), int(fields[28])  # fields 3, 9 and 31 of proc(5)
    if pending & SIGKILL_BIT:
        return "was sent SIGKILL"
    if flags & PF_EXITING or state in (b"Z", b"X", b"x"):
        return "is exiting"
    return None


def _looker(parent: int) -> Callable[[], str | None] | None:
    """A look at ``parent``'s stat line (see :func:`dying`; a read error means it is gone), or None
    where there is no /proc. The descriptor stays open: it answers for that process only, never
    for a later one that reuses the pid."""
    try:
        fd = os.open(f"/proc/{parent}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None

    def look() -> str | None:
        try:
            return dying(os.pread(fd, 4096, 0))
        except (OSError, ValueError, IndexError):
            return "is gone"

    return look


def died_between(alive_at: float, seen_at: float) -> float:
    """When a process died that a look found alive at ``alive_at`` and a later one found dying at
    ``seen_at``: the middle, at most half their gap from the truth. Pure."""
    return alive_at + max(0.0, seen_at - alive_at) / 2.0


class Sight:
    """The looks at the agent: the last time one found it alive (stamped before that look: it lived
    at least until then), the first time one found it dying (stamped after: it was dying by
    then), and a pipe whose read end wakes the thread (:func:`on_last_words`)."""

    def __init__(self, look: Callable[[], str | None], *, clock: Callable[[], float] = time.time) -> None:
        self._look, self._clock = look, clock
        self._lock = threading.Lock()
        self.alive_at = clock()
        self.dying_at: float | None = None
        self.glanced_at = float("-inf")  # the training thread's last look (glance), time.monotonic()
        self.woken, self._wake = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def look(self) -> str | None:
        """Why the agent is dying or dead, else None (and it was alive now)."""
        now = self._clock()
        why = self._look()
        with self._lock:
            if why is None:
                self.alive_at = max(self.alive_at, now)
            elif self.dying_at is None:
                self.dying_at = self._clock()
        return why

    def death(self, now: float) -> float:
        """When the agent died, as these looks tell (:func:`died_between`); ``now`` stands for the
        first sight of its death when no look found it dying (the pidfd or getppid told first)."""
        with self._lock:
            return died_between(self.alive_at, self.dying_at if self.dying_at is not None else now)

    def wake(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe has woken it already
            os.write(self._wake, b"!")

    def glance(self) -> None:
        """A look from the training thread: keeps the sign of life fresh; a dying agent wakes the
        thread, which looks again and says the last words. None within ``GLANCE_S`` of the last
        one that found the agent alive: a window's glances come closer than that (the step's and
        the next window's first micro-batch's, a few microseconds apart), and a look costs the
        training thread ~35 us of CPU between two steps (a tenth of that on a warm cache). So a
        short window looks once, a long one at its micro-batches, and the death is bracketed
        within GLANCE_S, timed within half of it; over GLANCED_S without a glance the thread looks."""
        if time.monotonic() - self.glanced_at < GLANCE_S:
            return
        if self.look() is None:
            self.glanced_at = time.monotonic()
        else:
            self.wake()


def glance() -> None:
    """The training thread's look at its agent (see the module docstring): nothing unless last
    words are wanted."""
    sight = _sight
    if sight is not None and _last_words:
        sight.glance()


def glancing(items: Iterator[T]) -> Iterator[T]:
    """``items``, with a :func:`glance` before each (the trainer's micro-batches) while last
    words are wanted; else ``items`` as they are (restart mode's micro-batches pass through no
    extra generator). Last words are asked for between windows, never inside one."""
    return _glancing(items) if _sight is not None and _last_words else items


def _glancing(items: Iterator[T]) -> Iterator[T]:
    for item in items:
        glance()
        yield item


def nap(seconds: float) -> None:
    """``time.sleep(seconds)`` that glances every ``GLANCE_S`` while last words are wanted."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        glance()
        time.sleep(min(left, GLANCE_S) if _last_words else left)


def period(
    *, now: float, glanced_at: float, wanted: bool, look_s: float, glanced_s: float, poll_s: float
) -> float:
    """The thread's sleep before its next look: ``poll_s`` when no last words are wanted; else
    ``glanced_s`` while the training thread glanced within the last ``glanced_s``, ``look_s``
    when it did not (it is busy elsewhere, or there is none: a spare, a save). Pure."""
    if not wanted:
        return poll_s
    return min(glanced_s if now - glanced_at <= glanced_s else look_s, poll_s)


def watch(
    parent: int,
    *,
    poll_s: float,
    look_s: float = LOOK_S,
    glanced_s: float = GLANCED_S,
    getppid: Callable[[], int] = os.getppid,
    on_orphan: Callable[[str], None] = _die,
    stop: threading.Event | None = None,
    pidfd: int | None = None,
    sight: Sight | None = None,
) -> None:
    """Wait until the parent exits (``pidfd`` readable), is found dying (``sight``: looked at
    every :func:`period`) or changes (``getppid``, at each wake-up), then say the last words and
    call ``on_orphan``; or until ``stop`` is set. The last words get the parent's death as the
    looks bracket it (:meth:`Sight.death`), or without a sight the time it was seen."""
    stop = stop or threading.Event()
    wakes = select.poll()  # not select(): no limit on the descriptor's number
    if pidfd is not None:
        wakes.register(pidfd, select.POLLIN)
    if sight is not None:
        wakes.register(sight.woken, select.POLLIN)
    while not stop.is_set():
        reason = None
        wait = poll_s
        if sight is not None:
            wait = period(now=time.monotonic(), glanced_at=sight.glanced_at, wanted=bool(_last_words),
                          look_s=look_s, glanced_s=glanced_s, poll_s=poll_s)  # fmt: skip
        if pidfd is not None or sight is not None:
            woke = {fd for fd, _ in wakes.poll(wait * 1000.0)}
            if sight is not None and sight.woken in woke:
                with contextlib.suppress(OSError):
                    os.read(sight.woken, 64)
            if pidfd in woke:
                reason = f"its agent (pid {parent}) exited"
                if sight is not None:
                    sight.look()  # stamps the first sight of its death: the bracket's end
        elif stop.wait(wait):
            return
        if reason is None and sight is not None and (why := sight.look()) is not None:
            reason = f"its agent (pid {parent}) {why}"
        if reason is None and (now_parent := getppid()) != parent:
            reason = f"its agent (pid {parent}) is gone (parent now {now_parent})"
        if reason is not None:
            say_last_words(sight.death(time.time()) if sight is not None else time.time())
            on_orphan(reason)
            return


def install(*, poll_s: float = 1.0, on_orphan: Callable[[str], None] = _die) -> Lifeline:
    """Arm the guards for the current parent (see the module docstring). Call it once, early,
    from the main thread."""
    parent = os.getppid()
    try:
        pidfd = _pidfd(parent)
    except ProcessLookupError:
        pidfd = None
        on_orphan(f"its agent (pid {parent}) died during start-up")
    armed = pidfd is None and _pdeathsig()  # with a pidfd the thread stops it, after its last words
    if os.getppid() != parent:  # the agent died between the two reads or before the guard took
        on_orphan(f"its agent (pid {parent}) died during start-up")
    global _sight
    look = _looker(parent)
    _sight = Sight(look) if look is not None else None
    thread = threading.Thread(
        target=watch, args=(parent,),
        kwargs={"poll_s": poll_s, "on_orphan": on_orphan, "pidfd": pidfd, "sight": _sight},
        name="elastrain-lifeline", daemon=True,
    )  # fmt: skip
    thread.start()
    return Lifeline(parent=parent, pidfd=pidfd is not None, pdeathsig=armed, watchdog=thread)
