"""Each worker process gets its share of the cores it is given: the service decides
``OMP_NUM_THREADS`` for every launch (unless the job's own env does) and the run record says so."""

from __future__ import annotations

from pathlib import Path

from service.launch import threads
from service.launch.apps import SchedulerSettings
from service.launch.dryrun import LocalLaunch, kubernetes_dryrun, worker_pod
from service.launch.protocol import NodeLaunch
from service.launch.torchx_scheduler import TorchXScheduler
from worker.jobspec.spec import JobSpec, parse_spec
from worker.start.threads import OMP, REASON_ENV, record


def make_spec(**over: object) -> JobSpec:
    base: dict[str, object] = {
        "name": "t", "model": {"name": "mlp"}, "data": {"name": "synthetic"},
        "micro_batch_size": 8, "max_steps": 10, "nodes": "2", "nproc_per_node": 2,
    }  # fmt: skip
    return parse_spec(base | over)


def test_local_processes_share_the_hosts_cores_by_slot() -> None:
    assert threads.local(cores=2, slots=2).count == 1
    assert threads.local(cores=16, slots=4).count == 4
    assert threads.local(cores=2, slots=8).count == 1  # more slots than cores: at least one
    assert threads.local(cores=7, slots=2).count == 3


def test_a_pod_shares_its_cpu_request_among_its_processes() -> None:
    assert threads.kubernetes(make_spec(resources={"cpu": "8"})).count == 4
    assert threads.kubernetes(make_spec(resources={"cpu": "1"})).count == 1
    assert threads.kubernetes(make_spec(resources={"cpu": "8"}, nproc_per_node=1)).count == 8
    unset = threads.kubernetes(make_spec())
    assert unset.count is None and "resources.cpu" in unset.reason


def test_the_jobs_own_env_decides_for_itself() -> None:
    share = threads.local(cores=16, slots=4)
    assert share.env(make_spec()) == {OMP: "4", REASON_ENV: share.reason}
    assert share.env(make_spec(env={OMP: "3"})) == {}


def test_a_local_launch_sets_the_share_and_keeps_the_jobs_choice(tmp_path: Path) -> None:
    settings = SchedulerSettings(
        rdzv_endpoint="http://etcd:2379", log_root=str(tmp_path), host_cores=8, local_slots=2
    )
    scheduler = TorchXScheduler(settings)
    try:
        plan = scheduler.dryrun(NodeLaunch("j", make_spec(), 0, "j-n0-a0"))
        assert isinstance(plan, LocalLaunch) and plan.env[OMP] == "4"
        assert "ELASTRAIN_LOCAL_SLOTS" in plan.env[REASON_ENV]
        own = scheduler.dryrun(NodeLaunch("j", make_spec(env={OMP: "2"}), 0, "j-n0-a1"))
        assert isinstance(own, LocalLaunch) and own.env[OMP] == "2" and REASON_ENV not in own.env
    finally:
        scheduler.close()


def test_a_pod_is_told_its_share_of_its_cpu_request() -> None:
    k8s = SchedulerSettings(scheduler="kubernetes", rdzv_endpoint="http://etcd:2379", worker_image="img:1")
    node = NodeLaunch("j", make_spec(resources={"cpu": "6"}), 0, "j-n0-a0")
    env = {
        e["name"]: e.get("value")
        for e in worker_pod(kubernetes_dryrun(node, k8s))["spec"]["containers"][0]["env"]
    }
    assert env[OMP] == "3" and "resources.cpu" in env[REASON_ENV]


def test_the_run_record_says_how_many_threads_and_who_decided() -> None:
    by_service = record({OMP: "4", REASON_ENV: "the service: ..."}, job_env={}, intra_op=4, inter_op=2)
    assert by_service == {"intra_op": 4, "inter_op": 2, OMP: "4", "decided_by": "the service: ..."}
    by_job = record({OMP: "3", REASON_ENV: "x"}, job_env={OMP: "3"}, intra_op=3, inter_op=2)
    assert by_job["decided_by"] == "the job's env"
    assert "torchrun" in record({OMP: "1"}, job_env={}, intra_op=1, inter_op=2)["decided_by"]
    assert "every core" in record({}, job_env={}, intra_op=16, inter_op=16)["decided_by"]
