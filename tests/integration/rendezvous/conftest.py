"""Fixtures for the etcd-v3 rendezvous tests: a real etcd, real torchrun agents on CPU/gloo.

Agents are started as ``python -m torch.distributed.run --rdzv-backend etcd-v3``: the backend
is found through the ``torchrun.handlers`` entry point. When the project is not pip-installed,
a throw-away ``*.dist-info`` that declares the same entry point is put on ``PYTHONPATH``.
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
ENTRY_POINT = "etcd-v3 = service.rendezvous:create_handler"


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture(scope="session")
def agent_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for torchrun agents: the repo importable, the entry point visible."""
    paths = [str(REPO)]
    if not any(ep.name == "etcd-v3" for ep in entry_points(group="torchrun.handlers")):
        site = tmp_path_factory.mktemp("entry-point")
        info = site / "elastrain_rdzv_test-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: elastrain-rdzv-test\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[torchrun.handlers]\n{ENTRY_POINT}\n")
        paths.insert(0, str(site))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "PET_"))}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the handler must set it itself
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
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
