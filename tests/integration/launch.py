"""Run the real worker: under torchrun (gloo, CPU) or as one plain process, and read its events."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def last(self, name: str) -> dict[str, Any]:
        found = [e for e in self.events if e["event"] == name]
        assert found, f"no {name!r} event; stderr tail:\n{self.stderr[-3000:]}"
        return found[-1]

    def all(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def before_last(self, name: str, anchor: str) -> list[dict[str, Any]]:
        """The ``name`` events written before the last ``anchor`` event, in stdout order: rank 0
        writes every event, one line at a time, and a re-formed group's rank 0 starts after the
        old group stopped, so the order of the lines is the order things happened (no clock)."""
        events = self.events
        cut = max((i for i, e in enumerate(events) if e["event"] == anchor), default=None)
        assert cut is not None, f"no {anchor!r} event; stderr tail:\n{self.stderr[-3000:]}"
        return [e for e in events[:cut] if e["event"] == name]


# Not inherited by the workers: the tests run what a user gets. torchrun's agent then shares its
# store with the workers across restarts (the worker protects itself: worker/start/dist.py), and sets
# OMP_NUM_THREADS=1 only when a node runs several processes (`python -m worker` and one-process
# runs use torch's default thread count, as they do for users). No PYTHONPATH either: `service`
# and `worker` are the installed distribution's (editable from `make venv`, a wheel in `make
# test-installed`); the tests' own modules (a team's model factory) are found from the working
# directory, REPO, where `python -m` looks first.
NOT_INHERITED = (
    "ELASTRAIN_FAILPOINTS",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "OMP_NUM_THREADS",
    "PYTHONPATH",
)


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    env.update(extra or {})
    return env


def write_spec(tmp: Path, spec: dict[str, Any], name: str = "spec.json") -> Path:
    path = tmp / name
    path.write_text(json.dumps(spec))
    return path


def torchrun_cmd(nproc: int, spec_path: Path, *, max_restarts: int = 0, module: str = "worker") -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        "-m",
        module,
        "--config",
        str(spec_path),
    ]


def run_worker(
    spec_path: Path,
    *,
    nproc: int = 0,
    max_restarts: int = 0,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> Run:
    """nproc=0 runs one plain process (no torchrun)."""
    if nproc:
        cmd = torchrun_cmd(nproc, spec_path, max_restarts=max_restarts)
    else:
        cmd = [sys.executable, "-m", "worker", "--config", str(spec_path)]
    proc = subprocess.run(cmd, env=worker_env(env), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return Run(proc.returncode, proc.stdout, proc.stderr)
