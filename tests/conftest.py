"""Hooks for the whole suite: a failed fault-row trial says its seed (tests/seeds.py), and a failed
test shows the logs of the services it started (tests/evidence.py)."""

from __future__ import annotations

import sys
from collections.abc import Generator

import pytest

from tests import evidence


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    evidence.test_started(item.nodeid)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    callspec = getattr(item, "callspec", None)
    seed = callspec.params.get("seed") if callspec is not None else None
    if report.failed and seed is not None:
        report.sections.append(
            ("fault seed", f"failed with seed={seed}: rerun with ELASTRAIN_FAULT_SEED={seed}")
        )
        sys.stderr.write(f"\nFAULT ROW FAILED: {item.nodeid} seed={seed}\n")
    if report.failed and call.when == "call":
        report.sections.extend(evidence.sections(item.nodeid))
    return report
