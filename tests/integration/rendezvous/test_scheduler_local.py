"""TorchXScheduler on ``local_cwd``: real node processes (torchrun agents on the etcd-v3 rendezvous).

The nodes run the rendezvous tests' tiny worker as their worker module, so these tests need
neither the real trainer nor the service.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.etcd.server import EtcdServer
from service.launch.apps import SchedulerSettings
from service.launch.protocol import NodeLaunch, NodeStatus
from service.launch.torchx_scheduler import LOCAL_PREFIX, TorchXScheduler
from worker.jobspec.spec import JobSpec, parse_spec

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
WORKER_MODULE = "tests.integration.rendezvous.rdzv_worker"
TESTS_ROOT = Path(__file__).resolve().parents[3]  # the directory holding tests/


def tiny_spec(nodes: str) -> JobSpec:
    return parse_spec(
        {
            "name": "sched-test",
            "model": {"name": "mlp"},
            "data": {"name": "synthetic"},
            "micro_batch_size": 1,
            "max_steps": 1,
            "nodes": nodes,
            "nproc_per_node": 1,
            "max_restarts": 1,
        }
    )


class Job:
    def __init__(self, scheduler: TorchXScheduler, workdir: Path, agent_env: dict[str, str]) -> None:
        self.scheduler = scheduler
        self.id = f"job-{uuid.uuid4().hex[:8]}"
        self.events_path = workdir / "events.jsonl"
        self.stop_path = workdir / "STOP"
        self.env = {
            # the nodes' worker module is the tests' own code (as a team's would be): its root on
            # the path; the package itself is the installed one
            "PYTHONPATH": str(TESTS_ROOT),
            "RDZV_TEST_OUT": str(self.events_path),
            "RDZV_TEST_STOP": str(self.stop_path),
        }

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        return [json.loads(x) for x in self.events_path.read_text().splitlines() if x.strip()]

    def node(self, spec: JobSpec, index: int, *, attempt: int = 0) -> NodeLaunch:
        return NodeLaunch(self.id, spec, index, f"{self.id}-n{index}-a{attempt}", self.env)

    def wait(self, what: str, predicate: Any, handles: list[str], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; logs:\n{self.logs(handles)}")

    def worlds(self) -> set[int]:
        return {e["world"] for e in self.events() if e["event"] == "step"}

    def logs(self, handles: list[str]) -> str:
        out = []
        for handle in handles:
            log_dir = self.scheduler.log_dir(handle)
            for path in sorted(log_dir.rglob("*.log")) if log_dir else []:
                out.append(f"--- {path}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)


@pytest.fixture
def settings(etcd: EtcdServer, tmp_path: Path) -> SchedulerSettings:
    return SchedulerSettings(
        rdzv_endpoint=etcd.endpoint, log_root=str(tmp_path / "nodes"), worker_module=WORKER_MODULE
    )


@pytest.fixture
def scheduler(settings: SchedulerSettings) -> Iterator[TorchXScheduler]:
    sched = TorchXScheduler(settings)
    yield sched
    sched.close()


def test_two_local_nodes_go_from_running_to_succeeded(
    scheduler: TorchXScheduler, settings: SchedulerSettings, agent_env: dict[str, str], tmp_path: Path
) -> None:
    job = Job(scheduler, tmp_path, agent_env)
    spec = tiny_spec("2")
    plan = scheduler.dryrun(job.node(spec, 0))
    first = scheduler.schedule(plan)  # exactly the plan: its handle, its command
    second = scheduler.launch(job.node(spec, 1))
    handles = [first, second]
    assert first == plan.handle
    # The same launch id again starts nothing and returns the same handle.
    assert scheduler.launch(job.node(spec, 0)) == first

    job.wait("a world of 2", lambda: job.worlds() == {2}, handles)
    assert [scheduler.status(h).state for h in handles] == ["running", "running"]
    wrapper = json.loads((plan.node_dir / "node.json").read_text())["pid"]
    running = Path(f"/proc/{wrapper}/cmdline").read_bytes().decode().split("\0")[:-1]
    assert running == plan.command  # the process is the planned one

    job.stop_path.touch()
    job.wait(
        "both nodes to succeed",
        lambda: all(scheduler.status(h).state == "succeeded" for h in handles),
        handles,
    )
    assert [scheduler.status(h) for h in handles] == [NodeStatus("succeeded", 0)] * 2
    assert len({e["pid"] for e in job.events()}) == 2, "each node ran exactly one worker"
    # A restarted service (a fresh scheduler) reads the same outcome from the node records.
    assert TorchXScheduler(settings).status(first) == NodeStatus("succeeded", 0)
    log_dir = scheduler.log_dir(first)
    assert log_dir is not None and any(log_dir.rglob("*.log"))


def test_a_killed_node_reports_failed_and_cancel_is_idempotent(
    scheduler: TorchXScheduler, agent_env: dict[str, str], tmp_path: Path
) -> None:
    job = Job(scheduler, tmp_path, agent_env)
    spec = tiny_spec("1:2")
    survivor = scheduler.launch(job.node(spec, 0))
    victim = scheduler.launch(job.node(spec, 1))
    handles = [survivor, victim]
    job.wait("a world of 2", lambda: job.worlds() == {2}, handles)

    # Lose node 1 the hard way: SIGKILL its torchrun agent and that agent's workers.
    record = json.loads((Path(victim.removeprefix(LOCAL_PREFIX)) / "node.json").read_text())
    agent_pid = int(record["child_pid"])
    workers = [e["pid"] for e in job.events() if _parent(e["pid"]) == agent_pid]
    for pid in [agent_pid, *workers]:
        os.kill(pid, signal.SIGKILL)
    job.wait("the killed node to fail", lambda: scheduler.status(victim).state == "failed", handles)
    assert scheduler.status(victim).exit_code == 128 + signal.SIGKILL
    job.wait("the survivor to re-form alone", lambda: 1 in job.worlds(), handles)
    assert scheduler.status(survivor).state == "running"

    scheduler.cancel(survivor)
    scheduler.cancel(survivor)  # again while it stops: no error, no second signal
    job.wait("the cancelled node to stop", lambda: scheduler.status(survivor).state != "running", handles)
    status = scheduler.status(survivor)
    assert status.state == "failed" and status.message == "cancelled"
    assert not [e for e in job.events() if e["event"] == "done"], "a cancelled node does not finish its work"
    scheduler.cancel(survivor)  # an ended node: nothing to do
    scheduler.cancel(victim)  # an ended node
    scheduler.cancel(LOCAL_PREFIX + str(tmp_path / "never-launched"))
    assert scheduler.status(LOCAL_PREFIX + str(tmp_path / "never-launched")).state == "unknown"


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def test_cancel_kills_a_node_whose_worker_ignores_sigterm(
    settings: SchedulerSettings, agent_env: dict[str, str], tmp_path: Path
) -> None:
    sched = TorchXScheduler(settings, cancel_grace_s=2.0)
    try:
        job = Job(sched, tmp_path, agent_env)
        job.env["RDZV_TEST_IGNORE_SIGTERM"] = "1"
        handle = sched.launch(job.node(tiny_spec("1"), 0))
        job.wait("the node to train", lambda: job.worlds() == {1}, [handle])
        worker = job.events()[-1]["pid"]

        sched.cancel(handle)
        job.wait(
            "the node to be killed", lambda: sched.status(handle).state != "running", [handle], timeout=60
        )
        assert sched.status(handle).state == "failed"
        job.wait("the stuck worker to be killed", lambda: not _running(worker), [handle], 30)
    finally:
        sched.close()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may linger until init reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
