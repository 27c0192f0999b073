"""On Kubernetes a job's minimum starts as one Volcano gang: the dry-run value shows its
``minAvailable``, its queue and its PriorityClass, and the scheduler submits exactly that value.
No Kubernetes API server or Volcano can run here: TorchX's runner is replaced where it would
call the API server (:class:`ApiServerStandIn`), and Volcano's admission rule for a Job's
``minAvailable`` is read by :func:`gang_min_available`."""

from __future__ import annotations

from typing import Any

from torchx import specs
from torchx.specs import AppDryRunInfo

from service.jobs.model import JobRecord, JobState, NodePhase, NodeRecord
from service.jobs.slots import Launch, gang
from service.launch.apps import SchedulerSettings
from service.launch.dryrun import (
    KubernetesLaunch,
    gang_min_available,
    kubernetes_dryrun,
    kubernetes_gang_dryrun,
)
from service.launch.protocol import NodeLaunch, gang_launcher
from service.launch.torchx_scheduler import TorchXScheduler
from tests.specs import make_spec

SPEC = make_spec("demo", nodes="3:5", nproc_per_node=2).model_copy(update={"priority": 10, "queue": "team-a"})
K8S = SchedulerSettings(
    scheduler="kubernetes", rdzv_endpoint="http://etcd:2379", worker_image="img:1", k8s_namespace="ml"
)
MINIMUM = [
    NodeLaunch("job-7", SPEC, i, f"job-7-n{i}-a0", {"ELASTRAIN_SERVICE_URL": "http://s"}) for i in range(3)
]


class ApiServerStandIn:
    """TorchX's Runner where it would talk to the API server: records what it schedules, answers
    a status with the tasks' states it is given, and records cancels."""

    def __init__(self) -> None:
        self.scheduled: list[AppDryRunInfo[Any]] = []
        self.tasks: dict[str, specs.AppState] = {}
        self.cancelled: list[str] = []

    def schedule(self, info: AppDryRunInfo[Any]) -> str:
        self.scheduled.append(info)
        job = info.request.resource
        return f"kubernetes://torchx/{job['metadata']['namespace']}:{job['metadata']['name']}"

    def status(self, handle: str) -> specs.AppStatus:
        roles = [specs.RoleStatus(r, [specs.ReplicaStatus(0, s, r, "")]) for r, s in self.tasks.items()]
        return specs.AppStatus(specs.AppState.RUNNING, roles=roles)

    def cancel(self, handle: str) -> None:
        self.cancelled.append(handle)

    def name(self) -> str:
        return "torchx"

    def close(self) -> None:
        pass


def env_of(task: dict[str, Any]) -> dict[str, str]:
    (container,) = task["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def test_the_minimum_is_one_gang_of_one_pod_per_node_in_the_jobs_queue_and_class() -> None:
    job = kubernetes_gang_dryrun(MINIMUM, K8S)
    spec = job["spec"]
    assert gang_min_available(job) == 3  # minimum nodes, one pod each (not nodes x processes)
    assert [t["minAvailable"] for t in spec["tasks"]] == [1, 1, 1]  # TorchX's min_replicas
    assert [t["replicas"] for t in spec["tasks"]] == [1, 1, 1]
    assert spec["queue"] == "team-a" and spec["priorityClassName"] == "elastrain-priority-10"
    assert spec["schedulerName"] == "volcano"
    assert [env_of(t)["ELASTRAIN_NODE_INDEX"] for t in spec["tasks"]] == ["0", "1", "2"]
    assert [env_of(t)["ELASTRAIN_LAUNCH_ID"] for t in spec["tasks"]] == [n.launch_id for n in MINIMUM]
    assert job["metadata"]["name"] == "job-7-n0-a0-gang" and job["metadata"]["namespace"] == "ml"


def test_a_node_launched_alone_is_a_gang_of_one() -> None:
    job = kubernetes_dryrun(MINIMUM[0], K8S)
    assert gang_min_available(job) == 1 and job["spec"]["queue"] == "team-a"


def test_the_gang_launch_submits_its_dry_run_value_and_each_member_has_its_own_state() -> None:
    api = ApiServerStandIn()
    scheduler = TorchXScheduler(K8S, runner=api)
    launch_gang = gang_launcher(scheduler)
    assert launch_gang is not None
    plan = scheduler.dryrun_gang(MINIMUM)
    assert isinstance(plan, KubernetesLaunch) and plan.volcano_job == kubernetes_gang_dryrun(MINIMUM, K8S)
    handles = launch_gang(MINIMUM)
    assert [info.request.resource for info in api.scheduled] == [plan.volcano_job]
    assert handles == [f"kubernetes://torchx/ml:job-7-n0-a0-gang#n{i}" for i in range(3)]
    api.tasks = {"n0": specs.AppState.RUNNING, "n1": specs.AppState.FAILED, "n2": specs.AppState.PENDING}
    assert [scheduler.status(h).state for h in handles] == ["running", "failed", "running"]
    scheduler.cancel(handles[1])  # it ended: the others go on
    assert api.cancelled == []
    scheduler.cancel(handles[0])  # a running member stops its gang
    assert api.cancelled == ["kubernetes://torchx/ml:job-7-n0-a0-gang"]


def test_one_machine_launches_no_gang(tmp_path: Any) -> None:
    local = TorchXScheduler(SchedulerSettings(rdzv_endpoint="http://e:2379", log_root=str(tmp_path)))
    try:
        assert gang_launcher(local) is None  # the local queue starts a job only when its minimum fits
    finally:
        local.close()


def record(*, nodes: str = "3:5", recovery: str = "restart", running: int = 0) -> JobRecord:
    lo, hi = (int(n) for n in nodes.split(":"))
    live = [NodeRecord(index=9, launch_id="j-n9-a0", phase=NodePhase.RUNNING, handle="h")] * running
    return JobRecord.model_validate(
        {"id": "j", "name": "n", "spec": make_spec("demo", nodes=nodes), "spec_hash": "h",
         "state": JobState.LAUNCHING, "state_since": 0.0, "desired_nodes": hi, "min_nodes": lo,
         "max_nodes": hi, "nproc_per_node": 1, "max_restarts": 3, "checkpoint_dir": "/c",
         "worker_token_hash": "x", "created_at": 0.0, "updated_at": 0.0, "recovery_mode": recovery,
         "nodes": live}
    )  # fmt: skip


def launches(*indices: int) -> list[Launch]:
    return [Launch(NodeRecord(index=i, launch_id=f"j-n{i}-a0")) for i in indices]


def test_the_gang_is_the_first_minimum_members_of_a_start() -> None:
    assert [n.index for n in gang(record(), launches(0, 1, 2, 3))] == [0, 1, 2]
    assert gang(record(), launches(0, 1)) == []  # fewer than the minimum: nothing to gang
    assert gang(record(running=1), launches(0, 1, 2)) == []  # joining a running group
    assert gang(record(recovery="peer"), launches(0, 1, 2)) == []  # peers are replaced one by one
    assert gang(record(nodes="1:4"), launches(0, 1)) == []  # a minimum of one is a node alone
    spare = Launch(NodeRecord(index=5, role="spare", launch_id="j-n5-a0"))
    assert [n.index for n in gang(record(), [spare, *launches(2, 1, 0)])] == [0, 1, 2]  # no spare
