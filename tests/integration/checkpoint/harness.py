"""Launch the toy job under real torchrun (gloo, CPU) and read its JSON events."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.integration.launch import worker_env

REPO = Path(__file__).resolve().parents[3]
TOY = Path(__file__).with_name("toy_train.py")


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    @property
    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.stdout.splitlines() if line.startswith("{")]

    def all(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name]

    def last(self, name: str) -> dict[str, Any]:
        found = self.all(name)
        assert found, f"no {name!r} event; stderr tail:\n{self.stderr[-4000:]}"
        return found[-1]

    def check(self) -> Run:
        if self.code != 0:
            first = [ln for ln in self.stderr.splitlines() if "Error" in ln or "error" in ln][:12]
            raise AssertionError(
                f"exit {self.code}; first error lines:\n"
                + "\n".join(first)
                + f"\nstderr tail:\n{self.stderr[-4000:]}"
            )
        return self


def env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The worker environment of tests/integration/launch.py: what a user gets (torchrun's agent
    shares its store across restarts; the toy creates its group with worker.start.dist.init_group,
    which survives that, pytorch/pytorch#135712): the kill test proves no restart is lost."""
    return worker_env(extra)


def torchrun_cmd(nproc: int, *args: str, max_restarts: int = 0) -> list[str]:
    """The command line that runs the toy job under torchrun."""
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}", "--monitor-interval=0.2", str(TOY), *args,
    ]  # fmt: skip


def torchrun(nproc: int, *args: str, max_restarts: int = 0, extra_env: dict[str, str] | None = None,
             timeout: float = 400) -> Run:  # fmt: skip
    cmd = torchrun_cmd(nproc, *args, max_restarts=max_restarts)
    proc = subprocess.run(cmd, env=env(extra_env), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return Run(proc.returncode, proc.stdout, proc.stderr)


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``elastrain checkpoint ...`` through the real dispatcher, in a fresh process."""
    code = "import sys; from service.cli import main; sys.exit(main(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "checkpoint", *argv]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, cwd=REPO, timeout=120)
