"""The README's own command, as a user types it, survives a SIGKILL (fault row ``bare-torchrun``).

``torchrun --nproc-per-node 2 --max-restarts 3 -m worker --config spec.json``, run in a directory
holding ``spec.json``, with the ``torchrun`` console script of this venv and the user's
environment: no ``--standalone``, so torchrun's default *static* rendezvous, whose store the
agent hosts on 127.0.0.1:29500 and shares with the workers across restarts (torchrun's
first-restart trap, pytorch#135712); no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` (it does nothing
for the static backend anyway), no ``OMP_NUM_THREADS`` (torchrun sets 1 itself for two
processes), no ``PYTHONPATH`` (``worker`` is the installed package's). The only addition:
``ELASTRAIN_FAILPOINTS`` to inject the kill.

One seeded rank is SIGKILLed at a seeded step after the first checkpoint, in the first attempt
only. The run must finish (exit 0, every restart it needs within the three), resume from the
newest checkpoint published before the kill and end digest-equal to the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.conftest import Reference
from tests.integration.launch import Run, write_spec
from tests.integration.worker.test_resume import spec
from tests.seeds import seeded

pytestmark = [pytest.mark.faults, pytest.mark.integration]
TORCHRUN = Path(sys.executable).with_name("torchrun")  # the venv's console script
STATIC_PORT = 29500  # torchrun's default --master-port: one such run at a time on a machine
RUN_TIMEOUT_S = 420  # far above a healthy run (~30 s): a hang fails the row within pytest's 600 s


HARNESS_VARIABLES = (
    "OMP_NUM_THREADS", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH",
)  # fmt: skip


def user_env(extra: dict[str, str]) -> dict[str, str]:
    """The caller's environment without what test harnesses add for workers."""
    prefixes = ("ELASTRAIN_", "TORCH_", "TORCHELASTIC_", "PET_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in HARNESS_VARIABLES}
    return env | extra


@contextlib.contextmanager
def static_port_lock() -> Iterator[None]:
    """Serialise runs on torchrun's default port between test sessions on this machine."""
    path = Path(tempfile.gettempdir()) / f"elastrain-torchrun-{STATIC_PORT}.lock"
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def bare_torchrun(workdir: Path, env: dict[str, str]) -> Run:
    """Run the README's command in ``workdir``; on a hang, kill the whole session and fail."""
    assert TORCHRUN.exists(), f"no torchrun console script next to {sys.executable}: run `make venv`"
    cmd = [
        str(TORCHRUN),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "-m",
        "worker",
        "--config",
        "spec.json",
    ]
    with static_port_lock():
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for pid in [
                proc.pid,
                *descendants(proc.pid),
            ]:  # torchrun starts each worker in a session of its own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"hung for {RUN_TIMEOUT_S} s; stderr tail:\n{err[-4000:]}")
    return Run(proc.returncode, out, err)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                found += kids
                todo += kids
    return found


@seeded
def test_bare_torchrun_survives_a_sigkill(tmp_path: Path, reference: Reference, seed: int) -> None:
    rng = random.Random(seed)
    rank, step = rng.randrange(2), rng.randrange(11, 30)
    arm = f"after_grad_sync=kill@{rank}#{step}^0"
    write_spec(tmp_path, spec(tmp_path / "ck"))
    run = bare_torchrun(tmp_path, user_env({"ELASTRAIN_FAILPOINTS": arm}))
    what = f"seed={seed} {arm}"
    assert run.code == 0, f"{what}: exit {run.code}; stderr tail:\n{run.stderr[-4000:]}"
    assert "elastrain failpoint after_grad_sync: kill" in run.stderr, f"{what}: the kill never happened"
    resumed = run.last("resumed")
    before = [e["step"] for e in run.before_last("checkpoint_published", "resumed")]
    assert before and resumed["step"] == max(before), f"{what}: resumed {resumed}"
    assert run.last("finished")["params_digest"] == reference.digest, what
