"""SIGSTOP a worker, then SIGCONT: the job finishes with the uninterrupted run's digest.

What torch 2.13 + gloo does (worker/start/dist.py init_group takes the collective timeout,
``ELASTRAIN_COLLECTIVE_TIMEOUT_S``, 12 s in these rows; torchrun's local agent watches only exit
codes, not liveness): a stop shorter than the timeout stalls the peers inside the all-reduce and
the group simply carries on after SIGCONT -- nothing re-forms (one group, no resume). A stop
longer than the timeout: the peer's collective times out, it names the rank it waited for and
the last step that rank completed (event ``collective_timeout``, :mod:`worker.start.hangs`), exits
non-zero, and torchrun tears down the group (including the stopped process) and restarts it from
the newest checkpoint.

Where the stop lands: the victim rank holds for a few seconds at a seeded training window (a
``sleep`` failpoint, first attempt only), and the test stops the very process whose failpoint
marker says it is holding there. Every other step runs at the real rate.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from service.report import build_report, load_run
from tests.faults.conftest import Reference
from tests.integration.launch import REPO, Run, torchrun_cmd, worker_env, write_spec
from tests.integration.worker.test_resume import spec
from tests.seeds import seeded
from worker.start.hangs import EVERY_S

pytestmark = [pytest.mark.faults, pytest.mark.integration]
COLLECTIVE_TIMEOUT_S = 12.0  # ELASTRAIN_COLLECTIVE_TIMEOUT_S for these rows (the default is 300 s)


def worker_pids(spec_path: Path) -> list[int]:
    """Worker processes (not the torchrun agent) started with ``--config spec_path``, by rank order."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(spec_path).encode() in cmd and b"torch.distributed.run" not in cmd and b"worker" in cmd:
            found.append(int(entry.name))
    return sorted(found)


HOLD_S = 5.0  # the victim holds this long at its window: the test's time to stop it there
BEACON_S = EVERY_S
HOLDING = re.compile(r"elastrain failpoint after_grad_sync: sleep:\S+ \(pid (\d+)\)")


def stop_and_continue(tmp: Path, seed: int, pause: float) -> tuple[Run, str, float]:
    """Run the W=2 job; stop the victim where it holds, for ``pause`` seconds. Returns the run,
    a description of where the stop landed (for messages) and when the stop was sent."""
    rng = random.Random(seed)
    victim_rank, window = rng.randrange(2), rng.randrange(12, 27)  # after the step-10 save
    arm = f"after_grad_sync=sleep:{HOLD_S:g}@{victim_rank}#{window}^0"
    spec_path = write_spec(tmp, spec(tmp / "ck"))
    out, err = (tmp / "stdout").open("w+"), (tmp / "stderr").open("w+")
    env = worker_env(
        {"ELASTRAIN_FAILPOINTS": arm, "ELASTRAIN_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S)}
    )
    cmd = torchrun_cmd(2, spec_path, max_restarts=2)
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (holding := HOLDING.search((tmp / "stderr").read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp / "stderr").read_text()[-3000:]
            time.sleep(0.05)
        victim = int(holding.group(1))
        # Inside the hold, past one beacon period: the victim's beacon (published once a second,
        # worker.start.hangs) has said the step it completed before the stop comes.
        time.sleep(BEACON_S + 0.5)
        stopped_at = time.time()
        os.kill(victim, signal.SIGSTOP)
        # Stopped in the middle of training: the run has not finished, the victim is its rank.
        assert '"event": "finished"' not in (tmp / "stdout").read_text(), "the stop came after the end"
        assert f"RANK={victim_rank}".encode() in (Path("/proc") / str(victim) / "environ").read_bytes().split(
            b"\0"
        )
        time.sleep(pause)  # the fault itself: how long the process stays stopped
        os.kill(victim, signal.SIGCONT)
        code = proc.wait(timeout=COLLECTIVE_TIMEOUT_S + 240)
    finally:
        if proc.poll() is None:
            proc.kill()
    run = Run(code, (tmp / "stdout").read_text(), (tmp / "stderr").read_text())
    return run, f"seed={seed} rank={victim_rank} window={window} pause={pause:.1f}s", stopped_at


@seeded
def test_sigstop_a_worker_then_sigcont(tmp_path: Path, reference: Reference, seed: int) -> None:
    pause = random.Random(seed + 1).uniform(2.0, 6.0)  # well inside the 12 s timeout
    run, what, _ = stop_and_continue(tmp_path, seed, pause)
    assert run.code == 0, f"{what}: {run.stderr[-3000:]}"
    # Nothing re-forms: one group from start to end, which never resumed from a checkpoint.
    assert len(run.all("run_record")) == 1 and not run.all("resumed"), f"{what}: the group re-formed"
    assert run.last("finished")["params_digest"] == reference.digest, what


@seeded
def test_sigstop_past_the_collective_timeout(tmp_path: Path, reference: Reference, seed: int) -> None:
    run, what, stopped_at = stop_and_continue(tmp_path, seed, COLLECTIVE_TIMEOUT_S + 12)
    assert run.code == 0, f"{what}: {run.stderr[-3000:]}"
    # The peer whose collective timed out names the stopped rank and the last step it completed.
    rng = random.Random(seed)
    victim, window = rng.randrange(2), rng.randrange(12, 27)
    (timeout,) = run.all("collective_timeout")
    assert timeout["missing_ranks"] == [victim], f"{what}: {timeout}"
    assert timeout["last_completed_steps"] == {str(victim): window - 1}, f"{what}: {timeout}"
    groups = run.all("run_record")
    assert len(groups) == 2, f"{what}: {len(groups)} groups, expected one re-formed group"
    published = [e["step"] for e in run.before_last("checkpoint_published", "resumed")]
    assert run.last("resumed")["step"] == max(published), f"{what}: not the newest published step"
    assert run.last("finished")["params_digest"] == reference.digest, what
    # The run's report times the failure at the stopped rank's last sign of life, not at its
    # detection (the peer's collective timing out): the recovery it records holds the stop.
    ran = load_run(tmp_path / "ck")
    (restart,) = build_report(ran)["restarts"]
    failed_at = ran.events[0]["time"] + restart["at_seconds"]
    first_step_at = failed_at + restart["recovery_seconds"]
    assert failed_at <= stopped_at + 0.002, f"{what}: failed at {failed_at}, stopped at {stopped_at}"
    assert stopped_at + COLLECTIVE_TIMEOUT_S <= first_step_at, f"{what}: {restart}"
