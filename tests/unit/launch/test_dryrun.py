"""Plan, then apply: a launch performs exactly the value its dry run returns, on Kubernetes and
on one machine, and the value says what will run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torchx.specs import AppDryRunInfo

from service.launch import torchx_scheduler
from service.launch.apps import SchedulerSettings, node_env
from service.launch.dryrun import KubernetesLaunch, LocalLaunch, kubernetes_dryrun, worker_pod
from service.launch.protocol import NodeLaunch
from service.launch.torchx_scheduler import LOCAL_PREFIX, TorchXScheduler
from tests.specs import make_spec
from worker.jobspec.spec import parse_spec

SPEC = make_spec("demo", nodes="1:2")
NODE = NodeLaunch("job-7", SPEC, 1, "job-7-n1-a3", {"ELASTRAIN_SERVICE_URL": "http://svc:8080"})
K8S = SchedulerSettings(
    scheduler="kubernetes", rdzv_endpoint="http://etcd:2379", worker_image="img:1", k8s_namespace="ml"
)


class ApiServerStandIn:
    """TorchX's Runner where it would talk to a Kubernetes API server (none can run here): it
    records what it was asked to schedule, and refuses a name it has seen, as the API server
    refuses a Volcano Job that already exists."""

    def __init__(self) -> None:
        self.scheduled: list[AppDryRunInfo[Any]] = []

    def schedule(self, info: AppDryRunInfo[Any]) -> str:
        job = info.request.resource
        if any(
            seen.request.resource["metadata"]["name"] == job["metadata"]["name"] for seen in self.scheduled
        ):
            raise ValueError(f"Job `{job['metadata']['name']}` already exists.")
        self.scheduled.append(info)
        return f"kubernetes://torchx/{job['metadata']['namespace']}:{job['metadata']['name']}"

    def name(self) -> str:
        return "torchx"

    def close(self) -> None:
        pass


def test_the_kubernetes_launch_schedules_its_dry_run_value() -> None:
    api = ApiServerStandIn()
    scheduler = TorchXScheduler(K8S, runner=api)  # type: ignore[arg-type]
    plan = scheduler.dryrun(NODE)
    assert isinstance(plan, KubernetesLaunch)
    assert plan.volcano_job == kubernetes_dryrun(NODE, K8S)  # what users and the chart's tests see
    handle = scheduler.schedule(plan)
    assert [info.request.resource for info in api.scheduled] == [plan.volcano_job]
    assert api.scheduled[0] is plan.request  # that value itself, not one built again
    assert handle == "kubernetes://torchx/ml:job-7-n1-a3"
    assert plan.name == "job-7-n1-a3" and plan.namespace == "ml"
    labels = worker_pod(plan.volcano_job)["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == "job-7-n1-a3"  # its pods carry the same name


def test_a_repeated_kubernetes_launch_is_the_first_one() -> None:
    api = ApiServerStandIn()
    scheduler = TorchXScheduler(K8S, runner=api)  # type: ignore[arg-type]
    first = scheduler.launch(NODE)
    assert scheduler.launch(NODE) == first  # the cluster refused the duplicate; same handle
    assert len(api.scheduled) == 1


@pytest.fixture
def local(tmp_path: Path) -> Iterator[TorchXScheduler]:
    settings = SchedulerSettings(rdzv_endpoint="http://etcd:2379", log_root=str(tmp_path / "nodes"))
    scheduler = TorchXScheduler(settings)
    yield scheduler
    scheduler.close()


def test_the_local_dry_run_says_what_will_run_and_touches_nothing(
    local: TorchXScheduler, tmp_path: Path
) -> None:
    plan = local.dryrun(NODE)
    assert isinstance(plan, LocalLaunch)
    node_dir = tmp_path / "nodes" / "job-7" / "job-7-n1-a3"
    assert plan.handle == LOCAL_PREFIX + str(node_dir) and plan.node_dir == node_dir
    assert plan.spec_path == node_dir / "spec.json" and parse_spec(plan.spec_json) == SPEC
    assert plan.log_dir == node_dir / "logs"
    command = plan.command
    wrapper = ["-m", "service.launch.node_exec", "--state-dir", str(node_dir), "--env"]
    assert command[1:6] == wrapper and command[7] == "--"
    assert set(node_env(NODE)) <= set(command[6].split(","))  # what the node keeps of its environment
    torchrun = command[8:]
    assert torchrun[1:3] == ["-m", "torch.distributed.run"] and "--rdzv-id=job-7" in torchrun
    assert torchrun[-2:] == ["--config", str(plan.spec_path)]
    for name, value in node_env(NODE).items():
        assert plan.env[name] == value, name
    assert not (tmp_path / "nodes").exists()  # a plan: nothing written, nothing started


TEAM = SPEC.model_copy(
    update={
        "image": "registry.example.com/team/worker:1.2",
        "env": {"PYTHONPATH": "/opt/team", "HF_HOME": "/tmp/hf"},
    }
)
TEAM_NODE = NodeLaunch("job-7", TEAM, 0, "job-7-n0-a0", {"ELASTRAIN_SERVICE_URL": "http://svc:8080"})


def test_a_jobs_image_and_env_are_what_its_pods_run() -> None:
    """A team ships its code in its own image (FROM the worker image) and
    sets its environment; the service's own variables still win."""
    pod = worker_pod(kubernetes_dryrun(TEAM_NODE, K8S))
    container = pod["spec"]["containers"][0]
    assert container["image"] == "registry.example.com/team/worker:1.2"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PYTHONPATH"] == "/opt/team" and env["HF_HOME"] == "/tmp/hf"
    assert env["ELASTRAIN_JOB_ID"] == "job-7" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    default = worker_pod(kubernetes_dryrun(NODE, K8S))["spec"]["containers"][0]
    assert default["image"] == "img:1"  # the service's worker image when the spec names none


def test_a_jobs_env_reaches_its_local_nodes_with_its_pythonpath_first(local: TorchXScheduler) -> None:
    plan = local.dryrun(TEAM_NODE)
    assert isinstance(plan, LocalLaunch)
    assert plan.env["HF_HOME"] == "/tmp/hf"
    paths = plan.env["PYTHONPATH"].split(os.pathsep)
    assert paths[0] == "/opt/team" and (Path(paths[-1]) / "worker").is_dir()  # then elastrain's


def test_the_jobs_queue_and_priority_class_are_in_the_volcano_job() -> None:
    """On Kubernetes the cluster's scheduler decides: the spec's ``queue`` (else the service's)
    and the PriorityClass of its ``priority`` go to Volcano through TorchX's options."""
    default = kubernetes_dryrun(NODE, K8S)["spec"]
    assert default["queue"] == "default" and "priorityClassName" not in default  # priority 0
    urgent = NodeLaunch(
        "job-7", SPEC.model_copy(update={"priority": 100, "queue": "team-a"}), 0, "job-7-n0-a0"
    )
    spec = kubernetes_dryrun(urgent, K8S)["spec"]
    assert spec["queue"] == "team-a" and spec["priorityClassName"] == "elastrain-priority-100"
    assert spec["schedulerName"] == "volcano"
    low = NodeLaunch("job-7", SPEC.model_copy(update={"priority": -5}), 0, "job-7-n0-a1")
    service_queue = SchedulerSettings(
        scheduler="kubernetes", rdzv_endpoint="http://etcd:2379", worker_image="img:1", k8s_queue="batch"
    )
    spec = kubernetes_dryrun(low, service_queue)["spec"]
    assert spec["queue"] == "batch" and spec["priorityClassName"] == "elastrain-priority-minus-5"


def test_a_launch_cut_off_before_its_node_started_is_launched_again_and_only_then(
    local: TorchXScheduler, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []
    monkeypatch.setattr(
        local._runner, "schedule", lambda request: started.append(request) or "local_cwd://t/x"
    )
    plan = local.dryrun(NODE)
    assert isinstance(plan, LocalLaunch)
    plan.node_dir.mkdir(parents=True)  # a service killed after making the directory, before the wrapper
    plan.spec_path.write_text(plan.spec_json)
    assert local.schedule(plan) == plan.handle and len(started) == 1  # started now
    # the wrapper is starting: its command line names the directory (it has not written node.json)
    booting = [b"python\0-m\0service.launch.node_exec\0--state-dir\0" + str(plan.node_dir).encode()]
    monkeypatch.setattr(torchx_scheduler, "_commands", lambda: iter(booting))
    assert local.schedule(plan) == plan.handle and len(started) == 1
    monkeypatch.setattr(torchx_scheduler, "_commands", lambda: iter([b"python\0-m\0other"]))
    (plan.node_dir / "node.json").write_text('{"pid": 1}')  # it started: the launch is that one
    assert local.schedule(plan) == plan.handle and len(started) == 1
