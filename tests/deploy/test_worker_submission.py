"""What the service, configured by the chart, would submit for a worker node (TorchX dry-run):
it mounts the chart's checkpoint claim and uses the chart's names, so the RBAC, NetworkPolicy,
PodMonitor and storage the chart sets up actually apply to the pods the service creates."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from service import settings as settings_module
from service.jobs.model import JobRecord
from service.jobs.objectstore import ObjectStorage
from service.launch import apps, dryrun
from service.launch.environment import launch_storage_env
from service.launch.protocol import NodeLaunch
from service.reconciler import LaunchContext, service_env
from tests.deploy.helpers import NAMESPACE, SCENARIOS, Obj, Renderer, chart_values, find, one
from tests.deploy.netpol import selector_matches
from tests.deploy.pss import restricted_violations
from tests.tls_certs import make_certs
from worker.etcdclient import TLS_ENV
from worker.jobspec.spec import JobSpec, parse_spec

POD_IP = "10.1.2.3"

SPEC: JobSpec = parse_spec(
    {
        "name": "hello",
        "model": {"name": "mlp"},
        "data": {"name": "synthetic"},
        "micro_batch_size": 32,
        "max_steps": 200,
        "nodes": "1:2",
    }
)


def _service_env(objects: list[Obj]) -> dict[str, str]:
    """The service container's environment as the kubelet would resolve it."""
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:  # $(NAME) of a variable defined above is expanded, as the kubelet does
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), item["value"])
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[item["name"]] = NAMESPACE
        elif item["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[item["name"]] = POD_IP
        elif "secretKeyRef" in item["valueFrom"]:
            env[item["name"]] = "t" * 40
        else:
            pytest.fail(f"cannot resolve {item}")
    return env


def _settings(objects: list[Obj], monkeypatch: pytest.MonkeyPatch) -> Any:
    for name in [n for n in os.environ if n.startswith("ELASTRAIN_")]:
        monkeypatch.delenv(name)
    for name, value in _service_env(objects).items():
        monkeypatch.setenv(name, value)
    return settings_module.load_settings()


def _dryrun(objects: list[Obj], monkeypatch: pytest.MonkeyPatch, node_index: int = 0) -> dict[str, Any]:
    settings = _settings(objects, monkeypatch)
    sched = apps.SchedulerSettings.from_settings(settings)
    node = NodeLaunch("job-7", SPEC, node_index, f"job-7-n{node_index}-a0")
    job: dict[str, Any] = dryrun.kubernetes_dryrun(node, sched)
    json.dumps(job)  # a plain, serialisable request
    return job


def test_every_chart_variable_is_a_setting(render: Renderer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each ELASTRAIN_* the chart sets is a field of the service's Settings (no typo is ignored)."""
    fields = set(settings_module.Settings.model_fields)
    for name in _service_env(render()):
        if name.startswith("ELASTRAIN_"):
            assert name.removeprefix("ELASTRAIN_").lower() in fields, name
    settings = _settings(render(), monkeypatch)
    assert settings.scheduler == "kubernetes"
    assert settings.service_url == "http://elastrain:8081"  # the chart's Service, its workers' port
    # where the other replicas reach this one (a standby forwards writes to the leader): the pod
    assert settings.instance_address == f"http://{POD_IP}:8080"


def _serve_command(objects: list[Obj]) -> tuple[list[str], dict[str, int], dict[str, object]]:
    """The service container's args and named ports, and the Service's ports by name."""
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service = {p["name"]: p["targetPort"] for p in one(objects, "Service", "elastrain")["spec"]["ports"]}
    return [str(a) for a in container["args"]], ports, service


def test_workers_call_a_port_of_their_own_unless_it_is_0(
    render: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's default: `serve --worker-port 8081`, the Service's `workers` port in front of
    it and the workers told it; `service.workerPort=0`: one port for everyone."""
    objects = render()
    args, ports, service = _serve_command(objects)
    assert args[args.index("--worker-port") + 1] == "8081" and ports["workers"] == 8081
    assert service == {"http": "http", "workers": "workers"}
    assert _settings(objects, monkeypatch).service_url == "http://elastrain:8081"
    objects = render(set_values=("service.workerPort=0",))
    args, ports, service = _serve_command(objects)
    assert "--worker-port" not in args and set(ports) == {"http"} and set(service) == {"http"}
    assert _settings(objects, monkeypatch).service_url == "http://elastrain:8080"


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_worker_pod_uses_the_charts_names(
    render: Renderer, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render(scenario)
    values = chart_values()
    env = _service_env(objects)
    job = _dryrun(objects, monkeypatch)
    assert job["apiVersion"] == "batch.volcano.sh/v1alpha1" and job["kind"] == "Job"
    assert job["metadata"]["namespace"] == NAMESPACE
    assert job["spec"]["queue"] == values["workers"]["queue"]
    pod = dryrun.worker_pod(job)
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["image"] == env["ELASTRAIN_WORKER_IMAGE"] == "elastrain/worker:0.1.0"
    # The workers' ServiceAccount exists in the render and gives no API token.
    assert spec["serviceAccountName"] == env["ELASTRAIN_K8S_SERVICE_ACCOUNT"]
    account = one(objects, "ServiceAccount", spec["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert spec.get("automountServiceAccountToken") is not True
    # The same checkpoint claim as the service, at the same path.
    claim = env["ELASTRAIN_CHECKPOINT_CLAIM"]
    service_pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert claim in {
        v["persistentVolumeClaim"]["claimName"]
        for v in service_pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    created = [pvc["metadata"]["name"] for pvc in find(objects, "PersistentVolumeClaim")]
    assert created == ([] if claim == "shared-ckpt" else [claim])  # shared-ckpt: existing-claim.yaml
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounted = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
    assert mounted[env["ELASTRAIN_CHECKPOINT_MOUNT"]]["persistentVolumeClaim"]["claimName"] == claim
    assert env["ELASTRAIN_CHECKPOINT_MOUNT"] == env["ELASTRAIN_STORAGE_ROOT"]
    # Rendezvous through the chart's etcd.
    assert f"--rdzv-endpoint={env['ELASTRAIN_ETCD']}" in container["command"] + container.get("args", [])


@pytest.mark.parametrize("scenario", ["default", "everything"])
def test_chart_policies_select_the_worker_pods(
    render: Renderer, scenario: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NetworkPolicy and PodMonitor select workers by labels: the submitted pods carry them."""
    objects = render(scenario, api_versions=("monitoring.coreos.com/v1",))
    labels = dryrun.worker_pod(_dryrun(objects, monkeypatch))["metadata"]["labels"]
    policy = one(objects, "NetworkPolicy", "elastrain-workers")
    assert selector_matches(policy["spec"]["podSelector"], labels)
    for monitor in find(objects, "PodMonitor"):
        assert selector_matches(monitor["spec"]["selector"], labels)
    service_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not selector_matches(policy["spec"]["podSelector"], service_labels)


def test_worker_pod_is_a_valid_pod(render: Renderer, monkeypatch: pytest.MonkeyPatch) -> None:
    pod = dryrun.worker_pod(_dryrun(render(), monkeypatch))
    obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "node-0", **pod["metadata"]},
        "spec": pod["spec"],
    }
    kubernetes_validate.validate(obj, "1.35.0", strict=True)


def test_worker_pod_meets_the_restricted_profile(render: Renderer, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = dryrun.worker_pod(_dryrun(render(), monkeypatch))["spec"]
    assert restricted_violations(spec) == []


def test_worker_pod_exposes_metrics_for_scraping(render: Renderer, monkeypatch: pytest.MonkeyPatch) -> None:
    pod = dryrun.worker_pod(_dryrun(render(), monkeypatch))
    port = chart_values()["workers"]["metricsPort"]
    assert port in {p["containerPort"] for p in pod["spec"]["containers"][0].get("ports", [])}
    annotations = pod["metadata"]["annotations"]
    assert annotations.get("prometheus.io/scrape") == "true"
    assert annotations.get("prometheus.io/port") == str(port)


def test_the_chart_runs_built_in_factories_only_unless_told(
    render: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The factory allowlist is on by default, with an empty list (built-ins only); the operator lists
    packages, or turns the limit off."""
    assert _settings(render(), monkeypatch).factory_prefixes == ()
    listed = render(set_values=("service.factoryAllowlist={team_a,team_b.models}",))
    assert _settings(listed, monkeypatch).factory_prefixes == ("team_a", "team_b.models")
    off = render(set_values=("service.restrictFactories=false",))
    assert _settings(off, monkeypatch).factory_prefixes is None


def test_workers_get_none_of_the_etcd_tls_files_the_chart_gives_the_service(
    render: Renderer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """etcd.external.tls: the chart mounts the Secret in the service's pod; a worker pod gets no
    Secret, no etcd TLS variable and no etcd endpoint (its rendezvous goes through the service).
    (The Secret's files are made here with openssl, where the kubelet would have put them.)"""
    (tmp_path / "made").mkdir()
    certs = make_certs(tmp_path / "made")
    mount = tmp_path / "etcd-tls"
    mount.mkdir()
    for key, made in (("ca.crt", "ca.crt"), ("tls.crt", "client.crt"), ("tls.key", "client.key")):
        (mount / key).write_bytes((certs / made).read_bytes())
    objects = render(
        "external-etcd",
        set_values=(
            "etcd.external.tls.existingSecret=infra-etcd-tls",
            "etcd.external.tls.clientCert=true",
            f"etcd.external.tls.mountPath={mount}",
        ),
    )
    settings = _settings(objects, monkeypatch)  # loads the files, as the service does at start
    ctx = LaunchContext(service_url=settings.service_url)
    record = JobRecord.model_construct(id="job-7", checkpoint_dir="/checkpoints/job-7", spec=SPEC)
    node = NodeLaunch("job-7", SPEC, 0, "job-7-n0-a0", service_env(record, ctx, "token"), recovery="peer")
    pod = dryrun.worker_pod(dryrun.kubernetes_dryrun(node, apps.SchedulerSettings.from_settings(settings)))
    (container,) = pod["spec"]["containers"]
    assert not [v for v in pod["spec"]["volumes"] if "secret" in v]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert not set(TLS_ENV) & set(env) and not [n for n in env if n.startswith("ELASTRAIN_ETCD")]
    assert env["ELASTRAIN_KV_GATEWAY"] == f"{settings.service_url}/v1/jobs/job-7/kv"
    assert restricted_violations(pod["spec"]) == []


def test_workers_of_a_job_on_s3_get_the_credentials_from_the_secret(
    render: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """objectStorage.secret: the service takes its own credentials from the Secret, and the worker
    pods of a job on s3:// get them by secretKeyRef from the same Secret, never as plain values
    (where the store is travels as a value); a job on the checkpoint volume gets none of them."""
    objects = render(
        set_values=(
            "objectStorage.secret=ckpt-s3",
            "objectStorage.endpoint=http://minio.storage:9000",
            "objectStorage.region=eu-1",
        )
    )
    service_env_ = _service_env(objects)  # a secretKeyRef resolves to "t" * 40 here
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
        if "secretKeyRef" in e.get("valueFrom", {})
    }
    assert refs["AWS_ACCESS_KEY_ID"]["name"] == refs["AWS_SECRET_ACCESS_KEY"]["name"] == "ckpt-s3"
    settings = _settings(objects, monkeypatch)
    storage = ObjectStorage.from_environ(service_env_)
    assert storage is not None and settings.storage_secret == "ckpt-s3"
    ctx = LaunchContext(
        service_url=settings.service_url, storage_env=launch_storage_env(storage, kubernetes=True)
    )
    sched = apps.SchedulerSettings.from_settings(settings)

    def worker_env(checkpoint_dir: str) -> list[dict[str, Any]]:
        spec = SPEC.model_copy(
            update={"checkpoint": SPEC.checkpoint.model_copy(update={"dir": checkpoint_dir})}
        )
        record = JobRecord.model_construct(id="job-7", checkpoint_dir=checkpoint_dir, spec=spec)
        node = NodeLaunch("job-7", spec, 0, "job-7-n0-a0", service_env(record, ctx, "token"))
        (container,) = dryrun.worker_pod(dryrun.kubernetes_dryrun(node, sched))["spec"]["containers"]
        return list(container["env"])

    env = worker_env("s3://ckpt/runs/job-7")
    by_name = {e["name"]: e for e in env}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert "value" not in by_name[name], by_name[name]
        assert by_name[name]["valueFrom"]["secretKeyRef"]["name"] == "ckpt-s3"
    assert by_name["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
    assert by_name["AWS_REGION"]["value"] == "eu-1"
    assert "t" * 40 not in json.dumps(env)  # no credential the service holds is a plain value
    assert not [e for e in worker_env("/checkpoints/job-7") if e["name"].startswith("AWS_")]


def test_with_a_role_for_the_service_accounts_every_pod_uses_its_own_identity(
    render: Renderer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """objectStorage.roleArn, no Secret (EKS IAM roles for service accounts): both ServiceAccounts
    carry the role; EKS gives the service's pod the web identity variables, which make it accept
    jobs on s3://; the worker pods of such a job get no credentials from the service, only where
    the store is, and resolve their own from their ServiceAccount's role."""
    role = "arn:aws:iam::123456789012:role/ckpt"
    objects = render(set_values=(f"objectStorage.roleArn={role}", "objectStorage.region=eu-1"))
    accounts = find(objects, "ServiceAccount")
    assert len(accounts) == 2
    assert all(a["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == role for a in accounts)
    irsa = {
        "AWS_ROLE_ARN": role,
        "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/secrets/eks.amazonaws.com/serviceaccount/token",
    }
    storage = ObjectStorage.from_environ(_service_env(objects) | irsa)  # what EKS's webhook adds
    settings = _settings(objects, monkeypatch)
    assert storage is not None and not settings.storage_secret
    ctx = LaunchContext(
        service_url=settings.service_url, storage_env=launch_storage_env(storage, kubernetes=True)
    )
    spec = SPEC.model_copy(
        update={"checkpoint": SPEC.checkpoint.model_copy(update={"dir": "s3://ckpt/runs/job-7"})}
    )
    record = JobRecord.model_construct(id="job-7", checkpoint_dir="s3://ckpt/runs/job-7", spec=spec)
    node = NodeLaunch("job-7", spec, 0, "job-7-n0-a0", service_env(record, ctx, "token"))
    sched = apps.SchedulerSettings.from_settings(settings)
    (container,) = dryrun.worker_pod(dryrun.kubernetes_dryrun(node, sched))["spec"]["containers"]
    aws = {e["name"]: e.get("value") for e in container["env"] if e["name"].startswith("AWS_")}
    assert aws == {"AWS_REGION": "eu-1"}
