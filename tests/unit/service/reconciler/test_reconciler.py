"""The leader's loop against the in-memory store and a fake scheduler: launches once, adopts
after a restart, recovers failed nodes, fences a stale leader."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.etcd.election import LeaderElection
from service.etcd.kv import put_if
from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.errors import NotLeaderError
from service.jobs.machine import Observation, reconcile
from service.jobs.model import JobState, NodePhase, Progress
from service.jobs.parts import JobParts
from service.launch.protocol import NodeLaunch, node_launch
from service.reconciler import LaunchContext, Reconciler
from tests.specs import raw_spec
from tests.unit.service.svc_fakes import Clock, FakeScheduler
from worker.jobspec.spec import parse_spec

SPEC = raw_spec("demo", micro_batch_size=4, nodes="1:3", max_restarts=2)


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.clock = Clock()
        self.store = MemoryStore(clock=self.clock)
        self.woken: list[str] = []
        self.parts = JobParts.build(
            self.store,
            storage_root=tmp_path,
            secret=b"k" * 32,
            on_job_write=self.woken.append,
            clock=self.clock,
        )
        self.jobs = self.parts.records
        self.scheduler = FakeScheduler()

    def reconciler(self, holder: str = "a") -> Reconciler:
        election = LeaderElection(self.store, holder, ttl_s=10, clock=self.clock)
        ctx = LaunchContext(service_url="http://svc:8080")
        return Reconciler(self.parts, self.scheduler, election, launch=ctx, clock=self.clock)

    def submit(self, **change: object) -> str:
        record, _ = self.jobs.create(parse_spec(SPEC | change))
        return record.id


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def test_submitted_job_is_launched_once_and_runs(world: World) -> None:
    job_id = world.submit(nodes="2")
    r = world.reconciler()
    assert r.run_once()
    assert world.scheduler.launch_ids == [f"{job_id}-n0-a0", f"{job_id}-n1-a0"]
    first = world.scheduler.launches[0]
    assert (first.job_id, first.node_index, first.spec.name) == (job_id, 0, "demo")
    assert first.env["ELASTRAIN_SERVICE_URL"] == "http://svc:8080"
    assert first.env["ELASTRAIN_WORKER_TOKEN"] == world.jobs.worker_token(job_id)
    assert first.env["ELASTRAIN_CHECKPOINT_DIR"] == world.jobs.get(job_id).checkpoint_dir
    r.run_once()
    record = world.jobs.get(job_id)
    assert record.state == JobState.RUNNING and all(n.handle for n in record.nodes)
    for _ in range(3):
        r.run_once()
    assert len(world.scheduler.launches) == 2


def test_a_restarted_service_adopts_its_nodes_and_launches_nothing(world: World) -> None:
    job_id = world.submit(nodes="2")
    world.reconciler().run_once()
    world.clock.advance(30)  # the old leader's lease expires (it was killed)
    fresh = world.reconciler(holder="b")
    assert fresh.run_once() and fresh.run_once()
    assert len(world.scheduler.launches) == 2
    assert world.jobs.get(job_id).state == JobState.RUNNING


def test_intent_recorded_before_a_crash_is_launched_under_the_same_id(world: World) -> None:
    job_id = world.submit(nodes="1")
    stored, revision = world.jobs.get_versioned(job_id)
    decision = reconcile(stored, Observation(now=world.clock()))
    assert put_if(world.store, keys.job(job_id), decision.job.to_json(), revision)  # crash after this write
    world.reconciler().run_once()
    assert world.scheduler.launch_ids == [f"{job_id}-n0-a0"]
    assert world.jobs.get(job_id).nodes[0].handle == f"fake://{job_id}-n0-a0"


def test_relaunch_of_an_orphaned_intent_that_did_launch_starts_nothing_new(world: World) -> None:
    job_id = world.submit(nodes="1")
    stored, revision = world.jobs.get_versioned(job_id)
    decision = reconcile(stored, Observation(now=world.clock()))
    put_if(world.store, keys.job(job_id), decision.job.to_json(), revision)
    node = decision.job.nodes[0]
    world.scheduler.launch(node_launch(decision.job, node, {}))
    world.reconciler().run_once()  # crash happened after launching, before recording the handle
    assert world.scheduler.calls == [node.launch_id, node.launch_id]
    assert len(world.scheduler.launches) == 1
    assert world.jobs.get(job_id).nodes[0].handle == f"fake://{node.launch_id}"


def test_failed_node_is_relaunched_then_the_job_fails_when_restarts_run_out(world: World) -> None:
    job_id = world.submit(nodes="1", max_restarts=1, recovery={"mode": "restart"})  # the restart path
    r = world.reconciler()
    r.run_once()
    world.scheduler.finish(f"{job_id}-n0-a0", exit_code=1)
    r.run_once()
    record = world.jobs.get(job_id)
    assert record.restarts == 1 and record.state == JobState.RECOVERING
    assert world.scheduler.launch_ids[-1] == f"{job_id}-n0-a1"
    world.scheduler.finish(f"{job_id}-n0-a1", exit_code=137)
    r.run_once()
    record = world.jobs.get(job_id)
    assert record.state == JobState.FAILED and "exit code 137" in (record.reason or "")


def test_success_and_cancel(world: World) -> None:
    done, cancelled = world.submit(nodes="1"), world.submit(nodes="2")
    r = world.reconciler()
    r.run_once()
    world.scheduler.finish(f"{done}-n0-a0")
    world.jobs.cancel(cancelled)
    r.run_once()
    assert world.jobs.get(done).state == JobState.SUCCEEDED
    assert world.jobs.get(cancelled).state == JobState.CANCELLED
    assert sorted(world.scheduler.cancelled) == [f"fake://{cancelled}-n0-a0", f"fake://{cancelled}-n1-a0"]
    r.run_once()
    assert [n.phase for n in world.jobs.get(cancelled).nodes] == [NodePhase.STOPPED] * 2


def test_scale_through_the_service_launches_and_stops_nodes(world: World) -> None:
    job_id = world.submit(nodes="1:3")
    r = world.reconciler()
    r.run_once()
    r.run_once()
    assert world.jobs.get(job_id).state == JobState.RUNNING
    world.jobs.scale(job_id, 1)
    r.run_once()
    assert world.jobs.get(job_id).state == JobState.RESCALING
    assert sorted(world.scheduler.cancelled) == [f"fake://{job_id}-n1-a0", f"fake://{job_id}-n2-a0"]


def test_launch_refused_by_the_scheduler_fails_the_job_with_its_message(world: World) -> None:
    job_id = world.submit(nodes="1", max_restarts=0, recovery={"mode": "restart"})  # no restart at all
    world.scheduler.refuse = "image 'nope' not found"
    world.reconciler().run_once()
    record = world.jobs.get(job_id)
    assert record.state == JobState.FAILED and "image 'nope' not found" in (record.reason or "")


def test_hung_node_without_heartbeats_is_replaced(world: World) -> None:
    job_id = world.submit(nodes="1")
    r = world.reconciler()
    r.run_once()
    r.run_once()
    world.parts.heartbeats.beat(job_id, f"{job_id}-n0-a0", 0, step=5)
    world.clock.advance(5)
    r.run_once()
    assert world.jobs.get(job_id).state == JobState.RUNNING
    world.clock.advance(120)  # heartbeats stopped (SIGSTOP) while the app still runs
    r.run_once()
    record = world.jobs.get(job_id)
    assert record.state == JobState.RECOVERING
    assert f"fake://{job_id}-n0-a0" in world.scheduler.cancelled
    assert world.scheduler.launch_ids[-1] == f"{job_id}-n0-a1"


def test_stale_leader_cannot_write(world: World) -> None:
    job_id = world.submit(nodes="1")
    old = world.reconciler("old")
    old.run_once()
    fence = old.election.fence
    assert fence is not None
    world.clock.advance(30)  # old leader paused past its lease
    new = world.reconciler("new")
    assert new.run_once()
    world.jobs.cancel(job_id)
    with pytest.raises(NotLeaderError):
        old.reconcile_job(job_id, fence)
    assert world.jobs.get(job_id).state == JobState.RUNNING  # nothing written by the stale leader
    assert not old.run_once()  # and it stays a follower while the new leader lives


def test_followers_do_nothing(world: World) -> None:
    world.submit(nodes="1")
    leader, follower = world.reconciler("a"), world.reconciler("b")
    assert leader.run_once()
    assert not follower.run_once()
    assert len(world.scheduler.launches) == 1


def test_passes_slow_down_while_every_job_runs_steadily_and_a_write_wakes_them(world: World) -> None:
    """Steadily RUNNING jobs need a pass only every idle interval; a job in motion, or any write
    of a job record (a submit, scale, cancel, worker event), brings the next pass forward."""
    job_id = world.submit(nodes="1:3", initial_nodes=1)
    r = world.reconciler()
    woken = world.woken
    r.run_once()  # launches: in motion
    assert r.busy
    r.run_once()  # the node runs: RUNNING, nothing to do
    r.run_once()
    assert not r.busy and world.jobs.get(job_id).state == JobState.RUNNING
    woken.clear()
    world.jobs.scale(job_id, 2)
    assert woken == [job_id]
    r.run_once()
    assert r.busy and world.jobs.get(job_id).state == JobState.RESCALING


def test_each_node_is_given_its_jobs_gateway_and_token_and_no_etcd_endpoint_or_credential(
    world: World,
) -> None:
    """A job reaches etcd only through the service's key-value gateway of that job."""
    r = world.reconciler()
    first, second = world.submit(nodes="2"), world.submit(nodes="1")
    r.run_once()
    envs = {n.launch_id: dict(n.env) for n in world.scheduler.launches}
    mine, other = envs[f"{first}-n0-a0"], envs[f"{second}-n0-a0"]
    assert mine["ELASTRAIN_KV_GATEWAY"] == f"http://svc:8080/v1/jobs/{first}/kv"
    assert other["ELASTRAIN_KV_GATEWAY"] == f"http://svc:8080/v1/jobs/{second}/kv"
    assert mine["ELASTRAIN_WORKER_TOKEN"] == world.jobs.worker_token(first) != other["ELASTRAIN_WORKER_TOKEN"]
    for env in envs.values():
        assert not [name for name in env if name.startswith("ELASTRAIN_ETCD")], env


class GangScheduler(FakeScheduler):
    """A scheduler that starts nodes together (as Volcano does on Kubernetes)."""

    gangs = True

    def __init__(self) -> None:
        super().__init__()
        self.gangs_launched: list[list[str]] = []

    def launch_gang(self, nodes: list[NodeLaunch]) -> list[str]:
        self.gangs_launched.append([n.launch_id for n in nodes])
        return [self.launch(n) for n in nodes]


def test_a_jobs_minimum_starts_as_one_gang_and_the_rest_alone(world: World) -> None:
    world.scheduler = GangScheduler()
    job_id = world.submit(nodes="2:3", recovery={"mode": "restart"})
    r = world.reconciler()
    r.run_once()
    assert world.scheduler.gangs_launched == [[f"{job_id}-n0-a0", f"{job_id}-n1-a0"]]
    assert world.scheduler.launch_ids == [f"{job_id}-n0-a0", f"{job_id}-n1-a0", f"{job_id}-n2-a0"]
    r.run_once()
    record = world.jobs.get(job_id)
    assert record.state == JobState.RUNNING and all(n.handle for n in record.nodes)
    world.scheduler.finish(f"{job_id}-n1-a0", exit_code=1)  # one member of the gang fails
    r.run_once()
    r.run_once()
    assert f"{job_id}-n1-a1" in world.scheduler.launch_ids  # replaced alone: the others run
    assert len(world.scheduler.gangs_launched) == 1


def test_a_gang_launched_before_a_crash_is_launched_again_as_the_same_gang(world: World) -> None:
    world.scheduler = GangScheduler()
    job_id = world.submit(nodes="2", recovery={"mode": "restart"})
    stored, revision = world.jobs.get_versioned(job_id)
    decision = reconcile(stored, Observation(now=world.clock()))
    put_if(world.store, keys.job(job_id), decision.job.to_json(), revision)
    world.scheduler.launch_gang([node_launch(decision.job, n, {}) for n in decision.job.nodes])
    world.reconciler().run_once()  # the leader died after the launch, before recording the handles
    gang = [f"{job_id}-n0-a0", f"{job_id}-n1-a0"]
    assert world.scheduler.gangs_launched == [gang, gang] and world.scheduler.launch_ids == gang
    assert [n.handle for n in world.jobs.get(job_id).nodes] == [f"fake://{i}" for i in gang]


def test_a_step_reported_while_a_pass_runs_counts_in_the_recovery_it_opens(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = world.submit(nodes="1", recovery={"mode": "restart"})
    r = world.reconciler()
    r.run_once()
    r.run_once()
    assert world.jobs.get(job_id).state == JobState.RUNNING
    # the pass reads every job's progress at its start; the report comes in after that read
    monkeypatch.setattr(world.parts.progress, "newest_of", lambda ids: dict.fromkeys(ids))
    world.parts.progress.report(world.jobs.get(job_id), Progress(step=12, time=world.clock()))
    world.scheduler.finish(f"{job_id}-n0-a0", exit_code=1)
    r.run_once()
    record = world.jobs.get(job_id)
    assert record.state == JobState.RECOVERING
    assert record.recoveries[0].step_before == 12  # the step the group had reached, not unknown
