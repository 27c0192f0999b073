"""Helpers for the deployment tests: rendering the chart into objects and finding things in it."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

from scripts.deploy_tools import CHART_DIR, DeployTools, render_chart

VALUES_DIR = Path(__file__).parent / "values"
RELEASE = "elastrain"
NAMESPACE = "elastrain"

Obj = dict[str, Any]
# The named scenarios every chart test runs over: values files under tests/deploy/values.
SCENARIOS: dict[str, tuple[str, ...]] = {
    "default": (),
    "external-etcd": ("external-etcd.yaml",),
    "existing-claim": ("existing-claim.yaml",),
    "ingress": ("ingress.yaml",),
    "everything": ("external-etcd.yaml", "existing-claim.yaml", "ingress.yaml", "monitoring.yaml"),
}


def parse_objects(stream: str) -> list[Obj]:
    return [doc for doc in yaml.safe_load_all(stream) if doc]


class Renderer:
    """Renders the chart with a scenario's values files (cached per session)."""

    def __init__(self, tools: DeployTools) -> None:
        self.tools = tools
        self._cache: dict[tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]], list[Obj]] = {}

    def __call__(
        self,
        scenario: str = "default",
        *,
        set_values: tuple[str, ...] = (),
        api_versions: tuple[str, ...] = (),
    ) -> list[Obj]:
        files = SCENARIOS[scenario]
        key = (files, set_values, api_versions)
        if key not in self._cache:
            text = render_chart(
                self.tools,
                values_files=tuple(VALUES_DIR / f for f in files),
                set_values=set_values,
                api_versions=api_versions,
                release=RELEASE,
                namespace=NAMESPACE,
            )
            self._cache[key] = parse_objects(text)
        return self._cache[key]


def helm(tools: DeployTools, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(tools.helm), *args], capture_output=True, text=True, check=False)


def find(objects: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_specs(objects: list[Obj]) -> dict[str, Obj]:
    """Pod template specs of every workload, by '<Kind>/<name>'."""
    return {
        f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    }


def chart_values() -> Obj:
    values: Obj = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    return values
