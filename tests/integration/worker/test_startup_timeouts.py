"""A rank whose peers never come exits 1 with one line saying what it waited for, never hangs.

The worker is started by hand with the environment torchrun gives a rank (RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_*), and ELASTRAIN_COLLECTIVE_TIMEOUT_S=3; its peer is never
started. Both of torchrun's store arrangements: the agent hosts the store (here the test does,
as the agent would) or worker rank 0 hosts it.
"""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.integration.launch import REPO, worker_env, write_spec
from tests.integration.worker.test_resume import spec

pytestmark = pytest.mark.integration
TIMEOUT_S = "3"


def rank_env(rank: int, port: int, *, agent_store: bool) -> dict[str, str]:
    return worker_env(
        {
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RUN_ID": "startup-test",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
            "ELASTRAIN_COLLECTIVE_TIMEOUT_S": TIMEOUT_S,
        }
    )


def run_alone(tmp: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    spec_path = write_spec(tmp, spec(tmp / "ck"))
    cmd = [sys.executable, "-m", "worker", "--config", str(spec_path)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_rank_1_without_rank_0_on_the_agents_store(tmp_path: Path) -> None:
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    proc = run_alone(tmp_path, rank_env(1, agent.port, agent_store=True))
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("elastrain worker (rank 1): error: waited 3.0 s for rank 0 to answer"), last
    assert "Traceback" not in proc.stderr


def test_rank_0_without_rank_1_on_its_own_store(tmp_path: Path) -> None:
    port = free_port()
    proc = run_alone(tmp_path, rank_env(0, port, agent_store=False))
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("elastrain worker (rank 0): error: waited "), last
    assert f"for the store at 127.0.0.1:{port}" in last, last
    assert "Traceback" not in proc.stderr
