"""A worker dies with its torchrun agent instead of training on as an orphan.

torchrun starts its workers in new sessions (``start_new_session=True``), so a SIGKILLed agent
leaves them running: the issue's orphan kept training with the survivors for 40 steps
(issue14-design.md E6: still alive after 5 s without protection). Two guards, in both recovery
modes:

* Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` — the kernel kills this process when the thread
  that forked it exits (torchrun forks from its main thread); then ``getppid()`` is checked
  again, since the agent may have died before the call (measured: gone 8-26 ms after the agent).
* Everywhere: a daemon thread compares ``getppid()`` with the agent's pid once a second and
  kills this process when it changed (35-46 ms at a 50 ms poll; within ``poll_s`` here).

Install it only in a process a torchrun agent started (:func:`should_install`): under a plain
``python -m worker`` the parent is a shell, and a worker need not die with its shell.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class Lifeline:
    """What was installed: the parent watched, and whether the kernel guard took."""

    parent: int
    pdeathsig: bool
    watchdog: threading.Thread


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


def watch(
    parent: int,
    *,
    poll_s: float,
    getppid: Callable[[], int] = os.getppid,
    on_orphan: Callable[[str], None] = _die,
    stop: threading.Event | None = None,
) -> None:
    """Poll until the parent changes (then ``on_orphan``) or ``stop`` is set."""
    stop = stop or threading.Event()
    while not stop.wait(poll_s):
        now = getppid()
        if now != parent:
            on_orphan(f"its agent (pid {parent}) is gone (parent now {now})")
            return


def install(*, poll_s: float = 1.0, on_orphan: Callable[[str], None] = _die) -> Lifeline:
    """Arm both guards for the current parent (see the module docstring). Call it once, early,
    from the main thread."""
    parent = os.getppid()
    armed = _pdeathsig()
    if os.getppid() != parent:  # the agent died between the two reads or before prctl took effect
        on_orphan(f"its agent (pid {parent}) died during start-up")
    thread = threading.Thread(
        target=watch, args=(parent,), kwargs={"poll_s": poll_s, "on_orphan": on_orphan},
        name="elastrain-lifeline", daemon=True,
    )  # fmt: skip
    thread.start()
    return Lifeline(parent=parent, pdeathsig=armed, watchdog=thread)
