"""Fixtures for the etcd-v3 rendezvous tests: a real etcd, real torchrun agents on CPU/gloo.

Agents are started as ``python -m torch.distributed.run --rdzv-backend etcd-v3``: torchrun finds
the backend through the ``torchrun.handlers`` entry point that the installed distribution
declares (``pyproject.toml``; ``make venv`` installs it editable, ``make test-installed`` from a
wheel), nothing the tests add.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

from service.etcd.server import EtcdServer

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("rdzv_worker.py")
ENTRY_POINT = "service.rendezvous:create_handler"  # torchrun.handlers etcd-v3, as pyproject.toml says


def declared_handler() -> str:
    """The ``etcd-v3`` torchrun handler the installed distribution declares (fails if none)."""
    found = [ep.value for ep in entry_points(group="torchrun.handlers") if ep.name == "etcd-v3"]
    assert found == [ENTRY_POINT], (
        f"the installed elastrain declares torchrun.handlers etcd-v3 = {found}, not {ENTRY_POINT!r} "
        "(is the project installed? `make venv`)"
    )
    return found[0]


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="session")
def agent_env() -> dict[str, str]:
    """Environment for torchrun agents: the caller's, without torchrun's own variables. The
    package and its entry point come from the installed distribution (no PYTHONPATH)."""
    declared_handler()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "PET_"))}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the handler must set it itself
    env.pop("PYTHONPATH", None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Cluster:
    """Agents of one rendezvous id, their worker events, and a stop switch."""

    def __init__(self, workdir: Path, endpoint: str, env: dict[str, str], *, nnodes: str) -> None:
        self.workdir = workdir
        self.endpoint = endpoint
        self.nnodes = nnodes
        self.run_id = f"rdzv-{uuid.uuid4().hex[:8]}"
        self.events_path = workdir / "events.jsonl"
        self.stop_path = workdir / "STOP"
        self.env = {**env, "RDZV_TEST_OUT": str(self.events_path), "RDZV_TEST_STOP": str(self.stop_path)}
        self.agents: list[subprocess.Popen[bytes]] = []

    def start_agent(self, *, max_restarts: int = 3, nproc: int = 1) -> subprocess.Popen[bytes]:
        index = len(self.agents)
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.nnodes}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
            str(WORKER),
        ]  # fmt: skip
        log = open(self.workdir / f"agent-{index}.log", "wb")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            cmd, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.agents.append(proc)
        return proc

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        lines = self.events_path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def wait_for(
        self, what: str, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 120.0
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.events()
            if predicate(events):
                return events
            if self.agents and all(agent.poll() is not None for agent in self.agents):
                break
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; logs:\n{self.logs()}")

    def stop_and_wait(self, timeout: float = 120.0) -> list[int | None]:
        self.stop_path.touch()
        deadline = time.monotonic() + timeout
        for agent in self.agents:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.wait(timeout=max(deadline - time.monotonic(), 1.0))
        return [agent.poll() for agent in self.agents]

    def logs(self) -> str:
        parts = []
        for path in sorted(self.workdir.glob("agent-*.log")):
            parts.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-4000:])
        return "\n".join(parts)

    def kill_all(self) -> None:
        pids = {event["pid"] for event in self.events()}
        for agent in self.agents:
            if agent.poll() is None:
                _kill_group(agent.pid)
                agent.wait()
        for pid in pids:
            _kill_group(pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def make_cluster(
    etcd: EtcdServer, agent_env: dict[str, str], tmp_path: Path
) -> Iterator[Callable[..., Cluster]]:
    clusters: list[Cluster] = []

    def make(*, nnodes: str) -> Cluster:
        workdir = tmp_path / f"cluster-{len(clusters)}"
        workdir.mkdir()
        cluster = Cluster(workdir, etcd.endpoint, agent_env, nnodes=nnodes)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.kill_all()
