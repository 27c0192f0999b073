"""node_app, node_env, kubernetes_dryrun and resources: what a node would run, as plain values."""

from __future__ import annotations

import json
from typing import Any

import pytest
from torchx import specs

from service.launch.apps import (
    K8S_SPEC_PATH,
    SPEC_ENV,
    SchedulerSettings,
    k8s_name,
    node_app,
    node_env,
    resource_from_spec,
)
from service.launch.dryrun import kubernetes_dryrun, worker_pod
from service.launch.protocol import NodeLaunch
from service.rendezvous.config import RendezvousConfig
from service.settings import Settings
from tests.specs import raw_spec
from worker.errors import SpecError
from worker.jobspec.spec import JobSpec, parse_spec


def make_spec(**overrides: Any) -> JobSpec:
    raw: dict[str, Any] = raw_spec("demo", nodes="1:3", nproc_per_node=2, max_restarts=5)
    raw.update(overrides)
    return parse_spec(raw)


def launch(
    job_id: str = "j", spec: JobSpec | None = None, index: int = 0, env: dict[str, str] | None = None
) -> NodeLaunch:
    return NodeLaunch(job_id, spec or make_spec(), index, f"{job_id}-n{index}-a0", env or {})


def flag(args: list[str], name: str) -> str:
    """The value of ``--name=value`` or ``--name value`` in an argument list."""
    for i, arg in enumerate(args):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name:
            return args[i + 1]
    raise AssertionError(f"{name} not in {args}")


def test_node_app_runs_one_torchrun_agent_on_the_etcd_v3_rendezvous() -> None:
    app = node_app(
        launch(
            "job-7",
            index=2,
            env={"ELASTRAIN_SERVICE_URL": "http://svc:8080", "ELASTRAIN_WORKER_TOKEN": "t0k"},
        ),
        rdzv_endpoint="http://etcd-0:2379,http://etcd-1:2379",
        image="/work",
        spec_path="/data/job-7/spec.json",
        python="/venv/bin/python",
    )
    assert len(app.roles) == 1
    role = app.roles[0]
    assert role.num_replicas == 1 and role.max_retries == 0
    assert role.entrypoint == "/venv/bin/python"
    args = role.args
    assert args[:2] == ["-m", "torch.distributed.run"]
    assert flag(args, "--nnodes") == "1:3"
    assert flag(args, "--nproc-per-node") == "2"
    assert flag(args, "--rdzv-backend") == "etcd-v3"
    assert flag(args, "--rdzv-endpoint") == "http://etcd-0:2379,http://etcd-1:2379"
    assert flag(args, "--rdzv-id") == "job-7"
    assert flag(args, "--max-restarts") == "5"
    assert args[-4:] == ["--module", "worker", "--config", "/data/job-7/spec.json"]
    conf = dict(kv.split("=") for kv in flag(args, "--rdzv-conf").split(","))
    assert conf["last_call_timeout"] == "3" and conf["keep_alive_interval"] == "2"
    assert role.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert role.env["ELASTRAIN_JOB_ID"] == "job-7"
    assert role.env["ELASTRAIN_NODE_INDEX"] == "2"
    assert role.env["ELASTRAIN_LAUNCH_ID"] == "job-7-n2-a0"
    assert role.env["ELASTRAIN_SERVICE_URL"] == "http://svc:8080"
    assert role.env["ELASTRAIN_WORKER_TOKEN"] == "t0k"
    assert SPEC_ENV not in role.env


def test_node_app_keeps_the_rendezvous_variables_over_callers_env() -> None:
    said = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0", "ELASTRAIN_NODE_INDEX": "9", "ELASTRAIN_JOB_ID": "x"}
    node = launch(spec=make_spec(nodes="2"), env=said)
    app = node_app(node, rdzv_endpoint="e:2379", image="i", spec_path="/s.json")
    env = app.roles[0].env
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1" and env["ELASTRAIN_NODE_INDEX"] == "0"
    assert env["ELASTRAIN_JOB_ID"] == "j" and env == node_env(node)
    assert flag(app.roles[0].args, "--nnodes") == "2:2"


def test_node_app_without_a_spec_path_ships_the_spec_in_the_environment() -> None:
    spec = make_spec()
    app = node_app(launch(spec=spec), rdzv_endpoint="e", image="img")
    role = app.roles[0]
    assert role.entrypoint == "sh" and role.args[0] == "-c"
    assert K8S_SPEC_PATH in role.args[1] and f"${SPEC_ENV}" in role.args[1]
    assert role.args[3:5] == ["python", "-m"]
    assert flag(role.args, "--config") == K8S_SPEC_PATH
    assert parse_spec(role.env[SPEC_ENV]) == spec


def test_node_app_passes_chosen_rendezvous_timeouts() -> None:
    rdzv = RendezvousConfig(last_call_timeout=1.5, keep_alive_interval=1.0, state_ttl=60)
    app = node_app(launch(), rdzv_endpoint="e", image="i", spec_path="/s", rdzv=rdzv)
    conf = dict(kv.split("=") for kv in flag(app.roles[0].args, "--rdzv-conf").split(","))
    assert (conf["last_call_timeout"], conf["keep_alive_interval"], conf["state_ttl"]) == ("1.5", "1", "60")


def test_node_app_refuses_a_negative_node_index() -> None:
    with pytest.raises(SpecError, match="node index"):
        node_app(launch(index=-1), rdzv_endpoint="e", image="i")


@pytest.mark.parametrize(
    ("resources", "expected"),
    [
        ({}, (-1, -1, -1)),
        ({"cpu": "4", "memory": "16Gi", "gpu": "1"}, (4, 1, 16384)),
        ({"memMB": "1000"}, (-1, -1, 1000)),
        ({"memory": "512Mi"}, (-1, -1, 512)),
        ({"memory": "2G"}, (-1, -1, 1907)),
    ],
)
def test_resources_map_to_torchx(resources: dict[str, str], expected: tuple[int, int, int]) -> None:
    res = resource_from_spec(resources)
    assert (res.cpu, res.gpu, res.memMB) == expected


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        ({"cores": "4"}, "unknown key"),
        ({"cpu": "four"}, "whole number"),
        ({"memory": "lots"}, "size like"),
        ({"memory": "1Gi", "memMB": "10"}, "not both"),
    ],
)
def test_bad_resources_are_refused_with_a_fix(resources: dict[str, str], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        resource_from_spec(resources)


def test_instance_type_becomes_a_node_selector_capability() -> None:
    res = resource_from_spec({"instance_type": "m5.xlarge"})
    assert res.capabilities == {"node.kubernetes.io/instance-type": "m5.xlarge"}


K8S = SchedulerSettings(
    scheduler="kubernetes",
    rdzv_endpoint="http://elastrain-etcd:2379",
    worker_image="registry.example/elastrain-worker:1.2",
    k8s_namespace="ml",
    k8s_queue="training",
    k8s_service_account="elastrain-worker",
    checkpoint_claim="elastrain-checkpoints",
    checkpoint_mount="/ckpt",
)


def test_kubernetes_dryrun_is_the_volcano_job_for_one_node() -> None:
    spec = make_spec(resources={"cpu": "4", "memory": "8Gi"})
    job = kubernetes_dryrun(launch("job-7", spec, 1, {"ELASTRAIN_SERVICE_URL": "http://svc"}), K8S)
    json.dumps(job)  # a plain, serialisable value
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1" and job["kind"] == "Job"
    assert job["metadata"]["namespace"] == "ml"
    assert job["metadata"]["name"] == "job-7-n1-a0"  # the launch id: a second launch is a duplicate
    assert job["spec"]["queue"] == "training"
    assert len(job["spec"]["tasks"]) == 1
    pod = worker_pod(job)
    assert pod["spec"]["serviceAccountName"] == "elastrain-worker"
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    assert container["image"] == "registry.example/elastrain-worker:1.2"
    command = container["command"]
    assert command[:2] == ["sh", "-c"] and "torch.distributed.run" in command
    assert flag(command, "--rdzv-endpoint") == "http://elastrain-etcd:2379"
    assert flag(command, "--rdzv-backend") == "etcd-v3"
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["ELASTRAIN_NODE_INDEX"] == "1" and env["ELASTRAIN_SERVICE_URL"] == "http://svc"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert parse_spec(env[SPEC_ENV]) == spec
    assert container["resources"]["limits"] == {"cpu": "4000m", "memory": "8192M"}


def test_kubernetes_dryrun_mounts_the_checkpoint_claim() -> None:
    pod = worker_pod(kubernetes_dryrun(launch("job-7"), K8S))
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert list(claims.values()) == ["elastrain-checkpoints"]
    (container,) = pod["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (volume,) = claims
    assert mounts[volume] == "/ckpt"


def test_kubernetes_dryrun_without_a_claim_mounts_no_volume() -> None:
    settings = SchedulerSettings(scheduler="kubernetes", rdzv_endpoint="e:2379", worker_image="img")
    pod = worker_pod(kubernetes_dryrun(launch(), settings))
    assert not [v for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert "serviceAccountName" not in pod["spec"] or pod["spec"]["serviceAccountName"] is None


def test_settings_refuse_what_cannot_work() -> None:
    with pytest.raises(SpecError, match="worker image"):
        SchedulerSettings(scheduler="kubernetes", rdzv_endpoint="e")
    with pytest.raises(SpecError, match="etcd endpoint"):
        SchedulerSettings(rdzv_endpoint=" ")
    with pytest.raises(SpecError, match="absolute"):
        SchedulerSettings(rdzv_endpoint="e", checkpoint_mount="ckpt")


def test_settings_from_the_service_settings() -> None:
    service_settings = Settings(
        scheduler="kubernetes",
        etcd="http://a:2379,http://b:2379",
        worker_image="img",
        k8s_namespace="ns",
        checkpoint_claim="claim",
        checkpoint_mount="/c",
    )
    settings = SchedulerSettings.from_settings(service_settings)
    assert settings.rdzv_endpoint == "http://a:2379,http://b:2379"
    assert (settings.scheduler, settings.worker_image, settings.k8s_namespace) == ("kubernetes", "img", "ns")
    assert (settings.k8s_queue, settings.k8s_service_account) == ("default", None)
    assert (settings.checkpoint_claim, settings.checkpoint_mount) == ("claim", "/c")


def test_k8s_names_are_dns_labels() -> None:
    assert k8s_name("Job_7/n0") == "job-7-n0"
    assert len(k8s_name("x" * 100)) == 50
    assert k8s_name("___") == "node"


def test_app_is_a_torchx_appdef() -> None:
    app = node_app(launch(), rdzv_endpoint="e", image="i", spec_path="/s")
    assert isinstance(app, specs.AppDef) and app.name == "j-n0"


def test_worker_pod_meets_the_restricted_profile_and_declares_metrics() -> None:
    pod = worker_pod(kubernetes_dryrun(launch("job-7"), K8S))
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
    assert spec["securityContext"]["fsGroup"] == 10001
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    assert spec["terminationGracePeriodSeconds"] == 25 + 5  # preemption.grace_s and a margin
    (container,) = spec["containers"]
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "metrics", "containerPort": 9400} in container["ports"]
    assert {"name": "ELASTRAIN_METRICS_PORT", "value": "9400"} in container["env"]
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == "9400"


def test_no_metrics_port_declares_none() -> None:
    settings = SchedulerSettings(
        scheduler="kubernetes", rdzv_endpoint="e", worker_image="img", metrics_port=None
    )
    pod = worker_pod(kubernetes_dryrun(launch(), settings))
    assert not pod["spec"]["containers"][0]["ports"]
    assert "prometheus.io/scrape" not in pod["metadata"]["annotations"]
