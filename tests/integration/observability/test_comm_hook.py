"""The DDP communication hook that times exposed communication changes no number when the
trainer steps as it does (no_sync micro-steps, gradients set to None after a step): three gloo
ranks (the mean by 1/3 is where a division-based hook would differ) train bit-identically with
and without it, with one bucket and with several, and the timer measures every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.launch import REPO, worker_env

pytestmark = pytest.mark.integration
PROBE = Path(__file__).with_name("comm_hook_probe.py")


def test_comm_hook_is_bit_identical_and_timed() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3", str(PROBE)]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert result["world_size"] == 3
    for cap, run in result["runs"].items():
        assert run["identical"], f"bucket_cap_mb={cap}: the hook changed the gradients"
        assert len(run["taken"]) == 4
        for exposed, total in run["taken"]:
            assert total > 0 and 0 <= exposed <= total + 1e-6, (cap, exposed, total)
