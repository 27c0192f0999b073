"""A worker dies with its torchrun agent instead of training on as an orphan.

torchrun starts its workers in new sessions (``start_new_session=True``), so a SIGKILLed agent
leaves them running: the issue's orphan kept training with the survivors for 40 steps
(issue14-design.md E6: still alive after 5 s without protection). Two guards, in both recovery
modes:

* Linux: a daemon thread waits on a pidfd of the agent (``os.pidfd_open``), which the kernel
  makes readable the moment the agent has exited -- the same moment it would send a parent-death
  signal -- and stamps that time. Before this process stops it says its last words
  (:func:`on_last_words`: peer mode tells the group "my node died at T" over its control
  connections, so the incident is timed from the agent's death, not from this process's own
  end some milliseconds later); they get at most ``LAST_WORDS_S``, then the process SIGKILLs
  itself. Where pidfds are missing (Linux < 5.3): ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` instead --
  the kernel kills this process when the thread that forked it exits (torchrun forks from its
  main thread), without last words.
* Everywhere: the same thread compares ``getppid()`` with the agent's pid once a second and
  stops this process when it changed; ``getppid()`` is also checked right after arming, since
  the agent may have died before (measured: gone 8-26 ms after the agent with the signal).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1
LAST_WORDS_S = 0.2  # what the last words may take before the process stops regardless

_last_words: list[Callable[[float], None]] = []
_last_words_lock = threading.Lock()


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


def watch(
    parent: int,
    *,
    poll_s: float,
    getppid: Callable[[], int] = os.getppid,
    on_orphan: Callable[[str], None] = _die,
    stop: threading.Event | None = None,
    pidfd: int | None = None,
) -> None:
    """Wait until the parent exits (``pidfd`` readable) or changes (polled every ``poll_s``),
    then say the last words and call ``on_orphan``; or until ``stop`` is set."""
    stop = stop or threading.Event()
    exits = select.poll()  # not select(): no limit on the descriptor's number
    if pidfd is not None:
        exits.register(pidfd, select.POLLIN)
    while not stop.is_set():
        reason = None
        if pidfd is not None:
            if exits.poll(poll_s * 1000.0):
                reason = f"its agent (pid {parent}) exited"
        elif stop.wait(poll_s):
            return
        if reason is None and (now := getppid()) != parent:
            reason = f"its agent (pid {parent}) is gone (parent now {now})"
        if reason is not None:
            say_last_words(time.time())
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
    thread = threading.Thread(
        target=watch, args=(parent,), kwargs={"poll_s": poll_s, "on_orphan": on_orphan, "pidfd": pidfd},
        name="elastrain-lifeline", daemon=True,
    )  # fmt: skip
    thread.start()
    return Lifeline(parent=parent, pidfd=pidfd is not None, pdeathsig=armed, watchdog=thread)
