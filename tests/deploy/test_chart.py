"""The chart as a user meets it: `helm lint --strict`, `helm template` for each scenario, every
rendered object valid for the Kubernetes API (kubernetes-validate, offline schemas), values the
schema refuses with a message naming the key, and NOTES that show how to submit a job."""

from __future__ import annotations

import base64
import copy
import json
import re

import kubernetes_validate
import pytest

from scripts.deploy_tools import CHART_DIR, DeployTools
from tests.deploy.helpers import (
    NAMESPACE,
    RELEASE,
    SCENARIOS,
    VALUES_DIR,
    Obj,
    Renderer,
    find,
    helm,
    one,
)
from worker.jobspec.spec import parse_spec

# Oldest supported (Chart.yaml kubeVersion) and the kubectl the tests use.
K8S_VERSIONS = ("1.27.0", "1.35.0")
# Kinds served by CRDs, which kubernetes-validate has no schema for; test_monitoring checks them.
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_helm_lint_strict(tools: DeployTools, scenario: str) -> None:
    args = ["lint", "--strict", str(CHART_DIR), "--namespace", NAMESPACE]
    for f in SCENARIOS[scenario]:
        args += ["--values", str(VALUES_DIR / f)]
    proc = helm(tools, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_rendered_object_is_valid(render: Renderer, scenario: str) -> None:
    objects = render(scenario)
    assert objects, "helm template rendered nothing"
    for obj in objects:
        if obj["kind"] in CRD_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(
                    f"{scenario}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {exc}"
                )
    unknown = {o["kind"] for o in objects} - CRD_KINDS - _validated_kinds(objects)
    assert not unknown, f"kinds with no schema and no CRD test: {unknown}"


def _validated_kinds(objects: list[Obj]) -> set[str]:
    kinds = set()
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
            kinds.add(obj["kind"])
        except kubernetes_validate.SchemaNotFoundError:
            pass
    return kinds


def test_the_validator_catches_a_misspelt_field(render: Renderer) -> None:
    """A control: the same validation refuses a Deployment with a typo in it."""
    deployment = copy.deepcopy(one(render(), "Deployment"))
    deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_default_render_has_the_expected_objects(render: Renderer) -> None:
    kinds = sorted(f"{o['kind']}/{o['metadata']['name']}" for o in render())
    assert kinds == sorted(
        [
            "Deployment/elastrain",
            "Service/elastrain",
            "ServiceAccount/elastrain",
            "ServiceAccount/elastrain-worker",
            "Role/elastrain-scheduler",
            "RoleBinding/elastrain-scheduler",
            "Secret/elastrain-api-token",
            "Secret/elastrain-etcd-root",
            "ConfigMap/elastrain-kubeconfig",
            "ConfigMap/elastrain-dashboards",  # deploy/grafana, copied into files/grafana
            "PersistentVolumeClaim/elastrain-checkpoints",
            "Service/elastrain-etcd",
            "StatefulSet/elastrain-etcd",
            "PodDisruptionBudget/elastrain-etcd",
            "NetworkPolicy/elastrain-service",
            "NetworkPolicy/elastrain-workers",
            "NetworkPolicy/elastrain-etcd",
        ]
    )
    assert all(o["metadata"].get("namespace") == NAMESPACE for o in render())


def _env(objects: list[Obj]) -> dict[str, Obj]:
    container = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e for e in container["env"]}


def test_etcd_statefulset_and_disruption_budget(render: Renderer) -> None:
    objects = render()
    sts = one(objects, "StatefulSet", "elastrain-etcd")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
    # 3.6.14 or later: 3.5 skips permission checks while a NOSPACE alarm is active
    found = re.fullmatch(r"quay\.io/coreos/etcd:v3\.6\.(\d+)", image)
    assert found and int(found.group(1)) >= 14, image
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        "--initial-cluster="
        + ",".join(f"elastrain-etcd-{i}=http://elastrain-etcd-{i}.elastrain-etcd:2380" for i in range(3))
        in args
    )
    assert one(objects, "Service", "elastrain-etcd")["spec"]["publishNotReadyAddresses"] is True
    pdb = one(objects, "PodDisruptionBudget", "elastrain-etcd")
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"] == sts["spec"]["selector"]
    endpoints = _env(objects)["ELASTRAIN_ETCD"]["value"].split(",")
    assert endpoints == [f"http://elastrain-etcd-{i}.elastrain-etcd:2379" for i in range(3)]


def test_five_member_etcd_keeps_quorum_in_its_budget(render: Renderer) -> None:
    objects = render(set_values=("etcd.replicas=5",))
    assert one(objects, "PodDisruptionBudget")["spec"]["minAvailable"] == 3
    assert len(_env(objects)["ELASTRAIN_ETCD"]["value"].split(",")) == 5


def test_external_etcd_replaces_the_statefulset(render: Renderer) -> None:
    objects = render("external-etcd")
    assert not find(objects, "StatefulSet") and not find(objects, "PodDisruptionBudget")
    assert not find(objects, "NetworkPolicy", "elastrain-etcd")
    assert _env(objects)["ELASTRAIN_ETCD"]["value"] == (
        "http://etcd-0.etcd.infra.svc:2379,http://etcd-1.etcd.infra.svc:2379,https://etcd-2.example.net:12379"
    )


TLS = ("etcd.external.tls.existingSecret=infra-etcd-tls", "etcd.external.tls.clientCert=true")


def test_external_etcd_over_tls_mounts_the_secret_for_the_service_only(
    render: Renderer,
) -> None:
    objects = render("external-etcd", set_values=TLS)
    env = _env(objects)
    assert {k: env[k]["value"] for k in env if k.startswith("ELASTRAIN_ETCD_") and "value" in env[k]} == {
        "ELASTRAIN_ETCD_USER": "elastrain-admin",
        "ELASTRAIN_ETCD_CA_CERT": "/etc/elastrain/etcd-tls/ca.crt",
        "ELASTRAIN_ETCD_CERT": "/etc/elastrain/etcd-tls/tls.crt",
        "ELASTRAIN_ETCD_KEY": "/etc/elastrain/etcd-tls/tls.key",
    }
    assert "ELASTRAIN_K8S_ETCD_TLS_SECRET" not in env  # worker pods get no etcd material
    deployment = one(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = [
        m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/etc/elastrain/etcd-tls"
    ]
    assert mount["readOnly"] is True
    assert volumes[mount["name"]]["secret"] == {"secretName": "infra-etcd-tls", "defaultMode": 0o440}
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(deployment, version, strict=True)
    # the CA only (an etcd without --client-cert-auth), at another path
    ca_only = _env(render("external-etcd", set_values=(TLS[0], "etcd.external.tls.mountPath=/etc/etcd-ca")))
    assert ca_only["ELASTRAIN_ETCD_CA_CERT"]["value"] == "/etc/etcd-ca/ca.crt"
    assert "ELASTRAIN_ETCD_CERT" not in ca_only and "ELASTRAIN_ETCD_KEY" not in ca_only
    # without the Secret: no TLS variables, no mount
    plain = render("external-etcd")
    assert not {"ELASTRAIN_ETCD_CA_CERT", "ELASTRAIN_K8S_ETCD_TLS_SECRET"} & set(_env(plain))
    assert not [v for v in one(plain, "Deployment")["spec"]["template"]["spec"]["volumes"] if "secret" in v]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ((TLS[0],), "etcd.external.tls.existingSecret needs https:// endpoints in etcd.external.endpoints"),
        (
            (TLS[0], "etcd.external.endpoints={http://etcd:2379}", "etcd.auth.existingSecret=p"),
            "etcd.external.tls.existingSecret needs https:// endpoints",
        ),
        (
            (
                TLS[0],
                "etcd.external.endpoints={https://etcd:2379}",
                "etcd.auth.existingSecret=p",
                "etcd.external.tls.ca=false",
            ),
            "etcd.external.tls: neither ca nor clientCert is true",
        ),
        (
            (
                TLS[0],
                "etcd.external.endpoints={https://etcd:2379}",
                "etcd.auth.existingSecret=p",
                "etcd.external.tls.mountPath=/checkpoints",
            ),
            "etcd.external.tls.mountPath /checkpoints is where the pods mount something else",
        ),
        (("etcd.external.tls.mountPath=etc/tls",), "at '/etcd/external/tls/mountPath'"),
        (("etcd.external.tls.existingSecret=Bad_Name",), "at '/etcd/external/tls/existingSecret'"),
    ],
    ids=["internal-etcd", "plain-http", "nothing-used", "mount-taken", "relative-mount", "bad-name"],
)
def test_etcd_tls_values_that_cannot_work_are_refused(
    tools: DeployTools, values: tuple[str, ...], message: str
) -> None:
    args = [a for v in values for a in ("--set", v)]
    proc = helm(tools, "template", RELEASE, str(CHART_DIR), *args)
    assert proc.returncode != 0, f"helm template accepted {values}"
    assert message in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def test_checkpoint_claim_created_or_existing(render: Renderer) -> None:
    created = one(render(), "PersistentVolumeClaim")
    assert created["spec"]["accessModes"] == ["ReadWriteMany"]
    assert created["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    objects = render("existing-claim")
    assert not find(objects, "PersistentVolumeClaim")
    env = _env(objects)
    assert env["ELASTRAIN_CHECKPOINT_CLAIM"]["value"] == "shared-ckpt"
    assert env["ELASTRAIN_CHECKPOINT_MOUNT"]["value"] == "/mnt/ckpt"
    assert env["ELASTRAIN_STORAGE_ROOT"]["value"] == "/mnt/ckpt"
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    assert claims[mounts["/mnt/ckpt"]] == "shared-ckpt"


def test_api_token_comes_from_a_secret(render: Renderer) -> None:
    generated = one(render(), "Secret", "elastrain-api-token")
    assert len(generated["data"]["token"]) >= 32
    assert _env(render())["ELASTRAIN_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "elastrain-api-token",
        "key": "token",
    }
    objects = render("existing-claim")  # also sets auth.existingSecret
    assert not find(objects, "Secret", "elastrain-api-token")
    assert _env(objects)["ELASTRAIN_API_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "my-token",
        "key": "api-token",
    }


def test_etcd_auth_is_on_with_a_generated_root_password(render: Renderer, tools: DeployTools) -> None:
    """The service is etcd's root (it turns auth on at its first start and gives
    each job a user of its own); the password is a Secret, generated once or the operator's."""
    secret = one(render(), "Secret", "elastrain-etcd-root")
    assert len(base64.b64decode(secret["data"]["password"])) >= 32
    env = _env(render())
    assert env["ELASTRAIN_ETCD_USER"]["value"] == "root"
    assert env["ELASTRAIN_ETCD_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "elastrain-etcd-root",
        "key": "password",
    }
    mine = render(set_values=("etcd.auth.existingSecret=ops-etcd", "etcd.auth.existingSecretKey=pw"))
    assert not find(mine, "Secret", "elastrain-etcd-root")
    assert _env(mine)["ELASTRAIN_ETCD_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "ops-etcd",
        "key": "pw",
    }
    off = render(set_values=("etcd.auth.enabled=false",))
    assert "ELASTRAIN_ETCD_PASSWORD" not in _env(off) and not find(off, "Secret", "elastrain-etcd-root")
    external = helm(
        tools, "template", RELEASE, str(CHART_DIR), "--set", "etcd.external.endpoints={http://etcd:2379}"
    )
    assert external.returncode != 0 and "etcd.auth.existingSecret" in external.stderr


def test_ingress_routes_to_the_service(render: Renderer) -> None:
    ingress = one(render("ingress"), "Ingress")
    rule = ingress["spec"]["rules"][0]
    assert rule["host"] == "train.example.com"
    assert rule["http"]["paths"][0]["backend"]["service"] == {"name": "elastrain", "port": {"name": "http"}}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "train-tls", "hosts": ["train.example.com"]}]
    assert not find(render(), "Ingress")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("etcd.replicas=2", "at '/etcd/replicas': value must be one of 1, 3, 5, 7"),
        ("service.replicas=two", "at '/service/replicas': got string, want integer"),
        ("servce.port=8080", "additional properties 'servce' not allowed"),
        ("checkpoints.accessModes={ReadWriteOnce}", "at '/checkpoints/accessModes'"),
        ("securityContext.runAsUser=0", "at '/securityContext/runAsUser': minimum: got 0, want 1"),
        ("etcd.external.endpoints={etcd:2379}", "at '/etcd/external/endpoints/0'"),
        ("service.image.tag=latest", "at '/service/image/tag'"),
        ("monitoring.serviceMonitor.enabled=sometimes", "at '/monitoring/serviceMonitor/enabled'"),
    ],
)
def test_schema_refuses_bad_values(tools: DeployTools, setting: str, message: str) -> None:
    for command in ("template", "lint"):
        args = [command, RELEASE, str(CHART_DIR)] if command == "template" else [command, str(CHART_DIR)]
        proc = helm(tools, *args, "--set", setting)
        assert proc.returncode != 0, f"helm {command} accepted {setting}"
        assert message in proc.stdout + proc.stderr, proc.stdout + proc.stderr


def _notes(tools: DeployTools, *extra: str) -> str:
    proc = helm(
        tools, "install", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE, "--dry-run=client", *extra
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("NOTES:", 1)[1]


def test_notes_show_how_to_submit_a_job(tools: DeployTools) -> None:
    notes = _notes(tools)
    assert "kubectl --namespace elastrain get secret elastrain-api-token" in notes
    assert "port-forward service/elastrain 8080:8080" in notes
    assert 'elastrain submit job.json --url "$ELASTRAIN_URL"' in notes
    assert 'curl -sS -X POST "$ELASTRAIN_URL/v1/jobs"' in notes
    assert "Authorization: Bearer $ELASTRAIN_API_TOKEN" in notes
    spec_text = notes.split("<<'SPEC'\n", 1)[1].split("SPEC", 1)[0]
    spec = parse_spec(json.loads(spec_text))  # the example spec is one the service accepts
    assert spec.nodes == "1:2"
    assert "install\nVolcano" in notes  # warns when the cluster has no Volcano


def test_notes_with_ingress_use_its_url(tools: DeployTools) -> None:
    notes = _notes(tools, "--values", str(VALUES_DIR / "ingress.yaml"))
    assert "export ELASTRAIN_URL=https://train.example.com" in notes
    assert "port-forward" not in notes
