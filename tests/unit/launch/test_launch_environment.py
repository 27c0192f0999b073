"""Nothing of the service's reaches a job's process: the local node's environment is an allowlist,
and the Kubernetes worker pod's environment holds the node's variables only (plain values)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from service.launch.apps import SchedulerSettings
from service.launch.dryrun import LocalLaunch, kubernetes_dryrun, worker_pod
from service.launch.environment import node_environment
from service.launch.protocol import NodeLaunch
from service.launch.torchx_scheduler import TorchXScheduler
from service.reconciler import LaunchContext, service_env
from worker.jobspec.spec import parse_spec

SPEC = parse_spec(
    {
        "name": "demo",
        "model": {"name": "mlp"},
        "data": {"name": "synthetic"},
        "micro_batch_size": 8,
        "max_steps": 10,
        "nodes": "1:2",
        "recovery": {"mode": "restart"},
        "env": {"TEAM_FLAG": "1"},
    }
)
SECRETS = {
    "ELASTRAIN_API_TOKEN": "api-token-0123456789abcdef",
    "ELASTRAIN_ETCD_PASSWORD": "root-password-of-etcd",
    "ELASTRAIN_ETCD_USER": "root",
    "ELASTRAIN_ETCD": "http://127.0.0.1:2379",
    "ELASTRAIN_ETCD_KEY": "/etc/elastrain/etcd-tls/tls.key",
    "ELASTRAIN_TOKEN_FILE": "/var/run/elastrain/token",
    "AWS_SECRET_ACCESS_KEY": "storage-secret",
    "AWS_ACCESS_KEY_ID": "storage-key",
    "GOOGLE_APPLICATION_CREDENTIALS": "/var/run/gcs.json",
}
MACHINE = {"PATH": "/usr/bin", "HOME": "/home/svc", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TMPDIR": "/tmp",
           "NCCL_DEBUG": "WARN", "ELASTRAIN_FAILPOINTS": "after_grad_sync=sleep:0.01"}  # fmt: skip


def launch() -> NodeLaunch:
    """A node as the reconciler launches it (the record: only what service_env reads)."""
    record: Any = SimpleNamespace(id="job-7", checkpoint_dir="/ckpt/job-7", spec=SPEC)
    env = service_env(record, LaunchContext("http://svc:8080"), "ewk.job-7.mac")
    return NodeLaunch("job-7", SPEC, 0, "job-7-n0-a0", env, recovery="restart")


def test_a_node_keeps_what_it_was_given_and_the_machines_allowed_variables_only() -> None:
    given = {"ELASTRAIN_WORKER_TOKEN": "ewk.j.x", "TEAM_FLAG": "1", "PYTHONPATH": "/code"}
    env = node_environment(SECRETS | MACHINE | given | {"RANDOM_HOST_VAR": "x"}, given)
    assert env == MACHINE | given


@pytest.fixture
def local(tmp_path: Path) -> Iterator[TorchXScheduler]:
    scheduler = TorchXScheduler(SchedulerSettings(rdzv_endpoint="http://etcd:2379", log_root=str(tmp_path)))
    yield scheduler
    scheduler.close()


def test_the_local_node_gets_none_of_the_services_secrets(local: TorchXScheduler) -> None:
    plan = local.dryrun(launch())
    assert isinstance(plan, LocalLaunch)
    names = plan.command[plan.command.index("--env") + 1].split(",")
    env = node_environment(SECRETS | MACHINE | plan.env, names)  # what node_exec hands the agent
    assert not set(SECRETS) & set(env) and not set(SECRETS.values()) & set(env.values())
    assert env["ELASTRAIN_WORKER_TOKEN"] == "ewk.job-7.mac" and env["TEAM_FLAG"] == "1"
    assert env["ELASTRAIN_KV_GATEWAY"] == "http://svc:8080/v1/jobs/job-7/kv"
    rdzv = [a for a in plan.command if a.startswith("--rdzv-endpoint=")]
    assert rdzv == ["--rdzv-endpoint=http://svc:8080/v1/jobs/job-7/kv"]  # not etcd's


def test_the_kubernetes_worker_pod_holds_no_secret_and_no_etcd_endpoint() -> None:
    settings = SchedulerSettings(
        scheduler="kubernetes", rdzv_endpoint="http://etcd:2379", worker_image="img:1", k8s_namespace="ml"
    )
    job = kubernetes_dryrun(launch(), settings)
    (container,) = worker_pod(job)["spec"]["containers"]
    env = {e["name"]: e.get("value", "") for e in container["env"]}
    assert not set(SECRETS) & set(env) and not set(SECRETS.values()) & set(env.values())
    assert not [name for name in env if name.startswith("ELASTRAIN_ETCD")]
    assert "etcd:2379" not in repr(job)  # the rendezvous goes through the gateway
    assert env["ELASTRAIN_KV_GATEWAY"] == "http://svc:8080/v1/jobs/job-7/kv"


def test_a_local_node_of_a_job_on_s3_gets_the_services_storage_variables_only_then(
    local: TorchXScheduler,
) -> None:
    """The service's object storage variables reach the nodes of a job whose checkpoints are on
    s3:// (after the job's own env, which cannot replace them), and no other job's."""
    storage = {"AWS_ACCESS_KEY_ID": "storage-key", "AWS_SECRET_ACCESS_KEY": "storage-secret"}
    ctx = LaunchContext("http://svc:8080", storage_env=storage | {"AWS_ENDPOINT_URL": "http://s3:8333"})
    mine = {"AWS_SECRET_ACCESS_KEY": "the-jobs-own", "AWS_ACCESS_KEY_ID": "jobs-key"}

    def node_env(checkpoint_dir: str) -> dict[str, str]:
        spec = SPEC.model_copy(update={"env": SPEC.env | mine})
        record: Any = SimpleNamespace(id="job-7", checkpoint_dir=checkpoint_dir, spec=spec)
        plan = local.dryrun(NodeLaunch("job-7", spec, 0, "job-7-n0-a0", service_env(record, ctx, "t")))
        assert isinstance(plan, LocalLaunch)
        names = plan.command[plan.command.index("--env") + 1].split(",")
        return node_environment(SECRETS | MACHINE | plan.env, names)

    on_s3 = node_env("s3://ckpt/runs/job-7")
    assert {k: on_s3[k] for k in storage} == storage and on_s3["AWS_ENDPOINT_URL"] == "http://s3:8333"
    on_disk = node_env("/ckpt/job-7")
    assert {k: on_disk[k] for k in mine} == mine and "AWS_ENDPOINT_URL" not in on_disk  # the job's own only
