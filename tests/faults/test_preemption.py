"""A SIGTERM from outside is a graceful stop under a bare torchrun (fault rows ``preempt-*``).

The README's command, ``torchrun --nproc-per-node 2 -m worker --config spec.json``, trains a
300-step job whose periodic checkpoint is every 100 steps. At a seeded step the test signals, with
``os.kill`` as a kubelet or a scheduler would:

* ``preempt-agent``: SIGTERM to the torchrun agent (a node's first process). The workers save the
  step they reached and torchrun exits non-zero; the same command resumes from that step.
* ``preempt-worker``: SIGTERM to one worker. The group stops at the same step on every rank,
  saves it, and torchrun (``--max-restarts 1``) starts the group again from it.
* ``preempt-job``: SIGTERM to every process of the job at once, then a second signal during the
  save (a second SIGTERM to all, or a SIGKILL to all): the newest published checkpoint stays
  intact whatever the second signal cut, and the next run resumes from it.

Each ends with the uninterrupted run's state digest (its last checkpoint's); with one signal no
step is trained twice (the run resumed at the step it stopped at).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from service.cli import main as elastrain
from tests.faults.conftest import train
from tests.faults.test_bare_torchrun import TORCHRUN, descendants, static_port_lock, user_env
from tests.integration.launch import REPO, Run, write_spec
from tests.integration.worker.test_resume import spec
from tests.integration.worker.test_service_e2e import digest
from tests.seeds import seeded, swept
from tests.shared_runs import once

pytestmark = [pytest.mark.faults, pytest.mark.integration]
STEPS = 300
RUN_TIMEOUT_S = 300  # far above a healthy run (~20 s here)


def preempt_spec(ck: Path) -> dict[str, Any]:
    return spec(ck, max_steps=STEPS, log_every_steps=10, checkpoint={"dir": str(ck), "interval_steps": 100})


@pytest.fixture(scope="session")
def preempt_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The uninterrupted run's final state digest (``elastrain checkpoint digest`` of its last
    checkpoint: parameters, optimizer, progress; trained once for the session's pytest
    processes)."""

    def reference(tmp: Path) -> str:
        train(tmp, "ref", max_steps=STEPS, log_every_steps=10,
              checkpoint={"dir": str(tmp / "ref"), "interval_steps": 100})  # fmt: skip
        return final_digest(tmp / "ref")

    return str(once(tmp_path_factory, "faults-preempt-reference", reference))


def final_digest(ck: Path) -> str:
    return digest(ck / f"step-{STEPS:08d}")


class Watched:
    """The README's command, running, its stdout read as it comes (rank 0's JSON events)."""

    def __init__(self, workdir: Path, *, max_restarts: int = 0) -> None:
        assert TORCHRUN.exists(), f"no torchrun console script next to {TORCHRUN.parent}"
        cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--max-restarts", str(max_restarts), "-m", "worker",
               "--config", "spec.json"]  # fmt: skip
        # PYTHONPATH: the worker of the tree under test, as `python -m` from the repository finds it
        env = user_env({"PYTHONPATH": str(REPO)})
        self.err = (workdir / "stderr.txt").open("w+")
        self.proc = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=self.err, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.step = 0
        self.changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.changed:
                self.lines.append(line)
                if line.startswith("{"):
                    event = json.loads(line)
                    if event["event"] == "progress":
                        self.step = max(self.step, int(event["step"]))
                self.changed.notify_all()

    def reach(self, step: int) -> None:
        """Wait until rank 0 reported ``step`` (or the run ended)."""
        with self.changed:
            ok = self.changed.wait_for(
                lambda: self.step >= step or self.proc.poll() is not None, RUN_TIMEOUT_S
            )
        assert ok and self.proc.poll() is None, f"the run ended before step {step}:\n{self.stderr()[-3000:]}"

    def workers(self) -> dict[int, int]:
        """Global rank -> pid of each live worker."""
        found = {}
        for pid in descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                env = dict(
                    kv.split("=", 1)
                    for kv in Path(f"/proc/{pid}/environ").read_text().split("\0")
                    if "=" in kv
                )
                if "RANK" in env and "worker" in Path(f"/proc/{pid}/cmdline").read_text():
                    found[int(env["RANK"])] = pid
        return found

    def finish(self) -> Run:
        try:
            code = self.proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_all([self.proc.pid, *descendants(self.proc.pid)], signal.SIGKILL)
            pytest.fail(f"hung for {RUN_TIMEOUT_S} s:\n{self.stderr()[-3000:]}")
        time.sleep(0.2)  # the reader's last lines
        return Run(code, "".join(self.lines), self.stderr())

    def stderr(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read()


def kill_all(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def published(ck: Path) -> list[int]:
    return sorted(int(p.parent.name.removeprefix("step-")) for p in ck.glob("step-*/manifest.json"))


def resume(workdir: Path, what: str) -> Run:
    """The same command again: it must finish."""
    with static_port_lock():
        run = Watched(workdir).finish()
    assert run.code == 0, f"{what}: the resumed run exited {run.code}:\n{run.stderr[-3000:]}"
    return run


@seeded
def test_sigterm_to_the_agent_saves_and_the_same_command_resumes(
    tmp_path: Path, preempt_digest: str, seed: int
) -> None:
    at = random.Random(seed).randrange(20, 250)
    write_spec(tmp_path, preempt_spec(tmp_path / "ck"))
    what = f"seed={seed} SIGTERM to the agent at step {at}"
    with static_port_lock():
        first = Watched(tmp_path)
        first.reach(at)
        os.kill(first.proc.pid, signal.SIGTERM)
        stopped = first.finish()
    assert stopped.code != 0, f"{what}: torchrun exited 0 for a run it did not finish"
    step = stopped.last("preempted")["step"]
    assert step >= at and max(published(tmp_path / "ck")) == step, f"{what}: {stopped.all('preempted')}"
    assert not stopped.all("finished"), f"{what}: the stopped run says it finished"
    run = resume(tmp_path, what)
    assert run.last("resumed")["step"] == step, f"{what}: steps were lost"
    assert final_digest(tmp_path / "ck") == preempt_digest, what


@seeded
def test_sigterm_to_one_worker_stops_the_group_at_one_step(
    tmp_path: Path, preempt_digest: str, seed: int
) -> None:
    rng = random.Random(seed)
    rank, at = rng.randrange(2), rng.randrange(20, 250)
    write_spec(tmp_path, preempt_spec(tmp_path / "ck"))
    what = f"seed={seed} SIGTERM to rank {rank} at step {at}"
    with static_port_lock():
        job = Watched(tmp_path, max_restarts=1)
        job.reach(at)
        os.kill(job.workers()[rank], signal.SIGTERM)
        run = job.finish()
    assert run.code == 0, f"{what}: exit {run.code}:\n{run.stderr[-3000:]}"
    step = run.last("preempted")["step"]
    assert step >= at and run.last("resumed")["step"] == step, f"{what}: steps were lost"
    assert final_digest(tmp_path / "ck") == preempt_digest, what


@seeded
@pytest.mark.parametrize("second", swept(["SIGTERM", "SIGKILL"]), ids=lambda s: s or "drawn")
def test_a_second_signal_during_the_save_keeps_the_published_checkpoint(
    tmp_path: Path, preempt_digest: str, seed: int, second: str | None
) -> None:
    """The whole job signalled at once, then again while it saves: the second SIGTERM changes
    nothing, a SIGKILL cuts the save; either way what was published verifies and the next run
    resumes from the newest of it."""
    rng = random.Random(seed)
    at, delay = rng.randrange(20, 250), rng.uniform(0.0, 0.15)
    second = second or rng.choice(["SIGTERM", "SIGKILL"])
    write_spec(tmp_path, preempt_spec(tmp_path / "ck"))
    what = f"seed={seed} SIGTERM to the job at step {at}, {second} {delay:.3f} s later"
    with static_port_lock():
        job = Watched(tmp_path)
        job.reach(at)
        everyone = [job.proc.pid, *job.workers().values()]
        kill_all(everyone, signal.SIGTERM)
        time.sleep(delay)
        kill_all(everyone, signal.Signals[second])
        stopped = job.finish()
    assert stopped.code != 0, what
    assert elastrain(["checkpoint", "verify", str(tmp_path / "ck")]) == 0, (
        f"{what}: a published checkpoint is damaged"
    )
    newest = max(published(tmp_path / "ck"), default=0)
    run = resume(tmp_path, what)
    resumed = run.last("resumed")["step"] if newest else 0
    assert resumed == newest, f"{what}: resumed {resumed}, newest published {newest}"
    if second == "SIGTERM":  # the save went on: nothing lost
        assert newest == stopped.last("preempted")["step"], f"{what}: the second SIGTERM cut the save"
    assert final_digest(tmp_path / "ck") == preempt_digest, what
