"""A reference run made once per test session, whichever pytest-xdist process asks first.

A session-scoped fixture is per process under pytest-xdist: with two processes, a reference that
modules on both need (the fault rows' uninterrupted runs) is trained twice, ~12 s of CPU each on
these 2 cores. :func:`once` runs ``make`` in a directory of the session's shared temporary root
under an exclusive ``flock``, keeps its JSON-able result beside it, and every later caller (this
process or the other) reads that result instead. A ``make`` that fails leaves no result: the
next caller runs it again and fails the same way, with its own traceback.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import pytest


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Any], Any]) -> Any:
    """``make(directory)`` once in this session, for every xdist process; its (JSON) result."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's root, shared by its xdist processes
    result = root / f"shared-{name}.json"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if result.is_file():
            return json.loads(result.read_text())
        directory = root / f"shared-{name}"
        shutil.rmtree(directory, ignore_errors=True)  # what a failed make left
        directory.mkdir()
        value = make(directory)
        result.write_text(json.dumps(value))
        return value
