"""deploy/k8s (the kustomize base for kubectl users) renders the same objects as the chart."""

from __future__ import annotations

import subprocess
from typing import Any

import kubernetes_validate

from scripts.deploy_tools import KUSTOMIZE_VALUES, REPO_ROOT, DeployTools, kustomize_drift, render_chart
from tests.deploy.helpers import NAMESPACE, Obj, Renderer, parse_objects

MONITORING_API = ("monitoring.coreos.com/v1",)


def kustomize(tools: DeployTools, path: str) -> list[Obj]:
    proc = subprocess.run(
        [str(tools.kubectl), "kustomize", str(REPO_ROOT / path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return parse_objects(proc.stdout)


def by_key(objects: list[Obj]) -> dict[str, Obj]:
    keyed = {f"{o['kind']}/{o['metadata']['name']}": o for o in objects}
    assert len(keyed) == len(objects), "two objects with the same kind and name"
    return keyed


def helm_with_kustomize_values(tools: DeployTools, api: tuple[str, ...] = ()) -> list[Obj]:
    text = render_chart(tools, values_files=(REPO_ROOT / KUSTOMIZE_VALUES,), api_versions=api)
    return parse_objects(text)


def _diff(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def test_kubectl_kustomize_renders_the_chart(tools: DeployTools, render: Renderer) -> None:
    ours = by_key(kustomize(tools, "deploy/k8s"))
    chart = by_key(helm_with_kustomize_values(tools))
    assert _diff(ours, chart) == [], "run: .venv/bin/python -m scripts.deploy_tools sync"
    assert all(o["metadata"]["namespace"] == NAMESPACE for o in ours.values())


def test_monitoring_overlay_adds_only_the_crd_objects(tools: DeployTools, render: Renderer) -> None:
    ours = by_key(kustomize(tools, "deploy/k8s/monitoring"))
    chart = by_key(helm_with_kustomize_values(tools, MONITORING_API))
    assert _diff(ours, chart) == []
    base = by_key(kustomize(tools, "deploy/k8s"))
    assert {o["kind"] for k, o in ours.items() if k not in base} <= {
        "ServiceMonitor",
        "PodMonitor",
        "PrometheusRule",
    }


def test_kustomize_and_default_chart_differ_only_in_the_secrets(tools: DeployTools, render: Renderer) -> None:
    """The one intended difference: kubectl users create the API token and etcd root password
    Secrets themselves (a generated secret must not be committed), so deploy/k8s/values.yaml
    names existing Secrets (of the same names and keys)."""
    ours = by_key(kustomize(tools, "deploy/k8s"))
    chart = by_key(render())
    assert _diff(ours, chart) == ["Secret/elastrain-api-token", "Secret/elastrain-etcd-root"]
    assert "Secret/elastrain-api-token" not in ours and "Secret/elastrain-etcd-root" not in ours
    env = ours["Deployment/elastrain"]["spec"]["template"]["spec"]["containers"][0]["env"]
    token = next(e for e in env if e["name"] == "ELASTRAIN_API_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "elastrain-api-token", "key": "token"}


def test_kustomize_objects_are_valid(tools: DeployTools) -> None:
    for obj in kustomize(tools, "deploy/k8s"):
        kubernetes_validate.validate(obj, "1.35.0", strict=True)


def test_generated_files_are_in_step(tools: DeployTools) -> None:
    drift = kustomize_drift(tools)
    assert not drift, "\n".join(drift) + "\nrun: .venv/bin/python -m scripts.deploy_tools sync"
