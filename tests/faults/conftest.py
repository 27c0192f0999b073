"""The fault matrix's shared pieces: seeds from the environment, the seed printed on failure,
and the uninterrupted reference run every worker row compares against.

Seeds: tests/seeds.py (every row is parametrised by them, ``seed=N``).
Every row runs in ``make test`` (one seed) and ``make faults``; a row that cannot run on a
machine skips with the reason (``make test`` prints it, ``-rs``; the runner's table says NOT RUN).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launch import Run, run_worker, write_spec
from tests.integration.worker.test_resume import spec
from tests.integration.worker.test_service_e2e import bare_run_digest
from tests.shared_runs import once

# tests/integration/service has no __init__.py; its helpers import as top-level modules there.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration" / "service"))


class Reference:
    """The uninterrupted 30-step W=2 run of test_resume's spec: its final digest."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.digest: str = run.last("finished")["params_digest"]


def train(tmp: Path, name: str, *, env: dict[str, str] | None = None, nproc: int = 2, **over: Any) -> Run:
    """Run test_resume's spec under torchrun (max_restarts=2) into ``tmp/name``; asserts exit 0."""
    run = run_worker(
        write_spec(tmp, spec(tmp / name, **over), f"{name}.json"), nproc=nproc, max_restarts=2, env=env
    )
    assert run.code == 0, run.stderr[-4000:]
    return run


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """Trained once for the session's pytest processes (tests.shared_runs)."""
    run = once(tmp_path_factory, "faults-reference", lambda tmp: asdict(train(tmp, "ref")))
    return Reference(Run(**run))


@pytest.fixture(scope="session")
def service_job_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The service rows' 30-step job on a bare torchrun: the digest it must end with under the
    service whatever happens (trained once for the session's pytest processes)."""
    return str(once(tmp_path_factory, "faults-bare30", lambda tmp: bare_run_digest(tmp, max_steps=30)))
