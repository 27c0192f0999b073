"""Waiting in a unit test for what another thread of the process does."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(what: str, check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Return once ``check()`` is true; fail the test if it is not within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.005)
    raise AssertionError(f"never: {what}")
