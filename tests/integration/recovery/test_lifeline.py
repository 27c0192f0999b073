"""A worker whose torchrun agent is SIGKILLed stops instead of training on as an orphan (torchrun
starts workers in their own session, so nothing else stops them). Real torchrun, real kill."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.demo import alive

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("lifeline_worker.py")
pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode", ["both", "watchdog"])
def test_the_orphan_is_gone_soon_after_its_agent(tmp_path: Path, mode: str) -> None:
    report = tmp_path / "pid"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "--max-restarts=0", "--monitor-interval=0.1", str(WORKER), str(report), mode]  # fmt: skip
    agent = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = 0
    try:
        deadline = time.monotonic() + 120
        while not report.exists() and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.05)
        assert report.exists(), "the worker never started"
        worker = int(report.read_text())
        assert alive(worker)
        killed, killed_at = time.monotonic(), time.time()
        agent.send_signal(signal.SIGKILL)
        sent_at = time.time()
        agent.wait()
        deadline = time.monotonic() + 30  # generous: the rule is "within a heartbeat", not a speed
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not alive(worker), "the orphaned worker kept running after its agent was killed"
        gone_ms = 1e3 * (time.monotonic() - killed)
        # its last words came before its end. With looks at /proc/<agent>/stat (install) the
        # kill lies between the last look that found the agent alive (no later than kill()'s
        # return: a pending SIGKILL shows before it) and the first that found it dying (no
        # earlier than the kill), and the words carry their middle; the getppid thread alone
        # sees the death only after it. Wall clock, all.
        bye = json.loads(Path(f"{report}.bye").read_text())
        said = bye["at"]
        if mode == "both":
            alive_at, dying_at = bye["alive_at"], bye["dying_at"]
            assert killed_at - 1.0 <= alive_at <= sent_at and killed_at <= dying_at <= time.time(), (
                killed_at, sent_at, bye)  # fmt: skip
            assert said == alive_at + (dying_at - alive_at) / 2, bye
        else:
            assert killed_at <= said <= time.time(), (killed_at, said)
        print(f"{mode}: the worker was gone {gone_ms:.0f} ms after the agent's SIGKILL, "
              f"and said the agent died {1e3 * (said - killed_at):.1f} ms after it")  # fmt: skip
    finally:
        if agent.poll() is None:
            agent.kill()
        if worker:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
