"""Waiting in a test for what another thread or process does: the one polling loop of the tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    what: str,
    check: Callable[[], T],
    timeout: float = 5.0,
    *,
    every: float = 0.005,
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """``check()``'s first true value, asked every ``every`` s; fail the test naming ``what`` if
    none comes within ``timeout`` s. An exception of ``ignoring`` (a service not answering yet)
    counts as a false value."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except ignoring:
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)
