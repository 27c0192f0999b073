"""What a failed test shows besides its assertion: the logs of the services it started.

A test that waits for a real service and real workers fails with "timed out waiting for ...";
the why is in the service's log and the nodes' stderr, which live in a temporary directory that
CI does not keep. A :class:`~tests.integration.worker.test_service_e2e.Service` registers itself
here when made; the suite's report hook (``tests/conftest.py``) appends the tails of the logs of
each service the failing test made, or that still runs, to the failure's report.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TAIL_CHARS = 6_000
"""Of each log, the end this much of it (the failure is near the end)."""


@dataclass
class Witness:
    made_by: str
    """The test that was running (or setting up) when it was made."""
    alive: Callable[[], bool]
    logs: Callable[[], dict[str, str]]
    """Name -> text, read when a test fails."""


_current = [""]
_witnesses: list[Witness] = []


def test_started(nodeid: str) -> None:
    """The report hook says which test runs now (set before its fixtures)."""
    _current[0] = nodeid
    _witnesses[:] = [w for w in _witnesses if w.alive()]  # a finished one has nothing to add


def keep(alive: Callable[[], bool], logs: Callable[[], dict[str, str]]) -> None:
    _witnesses.append(Witness(_current[0], alive, logs))


def sections(nodeid: str) -> list[tuple[str, str]]:
    """(title, tail) per log of each witness the test ``nodeid`` made or that still runs."""
    out: list[tuple[str, str]] = []
    for witness in _witnesses:
        if witness.made_by != nodeid and not witness.alive():
            continue
        try:
            logs = witness.logs()
        except OSError as exc:
            logs = {"logs": f"could not be read: {exc}"}
        for name, text in logs.items():
            if text:
                out.append((f"{name} (last {TAIL_CHARS} characters)", text[-TAIL_CHARS:]))
    return out
