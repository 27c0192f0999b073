"""A straggler made from outside the worker: a SIGSTOP/SIGCONT duty cycle on one process.

The cycling runs in a process of its own. In the test's process it shared the interpreter lock
with whatever the test checked meanwhile (a service's answer, a growing log): on a loaded machine
the thread holding the lock is descheduled, the cycle waits for it, and the stopped process runs
free for as long, which looks like no slowdown at all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

STOP_S, RUN_S = 0.05, 0.005  # stopped 10x as long as it runs: a rank several times slower
CHECK_S = 0.05
"""How often ``done()`` is asked while the cycler runs."""

_CYCLER = """
import os, signal, sys, time
pid, stop_s, run_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
try:
    os.nice(-10)  # a precise cycle on a loaded machine where allowed (root); else as it is
except OSError:
    pass
ending, cycles = [], 0
signal.signal(signal.SIGTERM, lambda *_: ending.append(1))
try:
    while not ending:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(stop_s)
        os.kill(pid, signal.SIGCONT)
        time.sleep(run_s)
        cycles += 1
except ProcessLookupError:
    pass
finally:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
    print(cycles, flush=True)
"""


def stop_cycles(pid: int, done: Callable[[], bool]) -> str:
    """Stop and continue ``pid`` from a process of its own until ``done()`` (asked every
    :data:`CHECK_S` s here) or the process is gone; it is left running. Says how many cycles
    ran, over how long."""
    began = time.monotonic()
    cycler = subprocess.Popen(
        [sys.executable, "-c", _CYCLER, str(pid), str(STOP_S), str(RUN_S)], stdout=subprocess.PIPE
    )
    try:
        while cycler.poll() is None and not done():
            time.sleep(CHECK_S)
    finally:
        if cycler.poll() is None:
            cycler.send_signal(signal.SIGTERM)
        out, _ = cycler.communicate(timeout=30)
        if (Path("/proc") / str(pid)).exists():
            os.kill(pid, signal.SIGCONT)
    return f"{out.decode().strip() or '?'} stop cycles in {time.monotonic() - began:.1f} s"
