"""A straggler made from outside the worker: a SIGSTOP/SIGCONT duty cycle on one process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

STOP_S, RUN_S = 0.05, 0.005  # stopped 10x as long as it runs: a rank several times slower


def stop_cycles(pid: int, done: Callable[[], bool]) -> str:
    """Stop and continue ``pid`` until ``done()`` (asked before each cycle) or the process is
    gone; it is left running. Says how many cycles ran, over how long."""
    began, cycles = time.monotonic(), 0
    try:
        while not done():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOP_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(RUN_S)
            cycles += 1
    except ProcessLookupError:
        pass
    finally:
        if (Path("/proc") / str(pid)).exists():
            os.kill(pid, signal.SIGCONT)
    return f"{cycles} stop cycles in {time.monotonic() - began:.1f} s"
