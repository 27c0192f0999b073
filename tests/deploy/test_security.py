"""Security contexts, resources and service-account tokens of every pod the chart renders."""

from __future__ import annotations

import pytest

from tests.deploy.helpers import SCENARIOS, Obj, Renderer, find, one, pod_specs
from tests.deploy.pss import restricted_violations

# The workloads each scenario renders: the loops below must see every one (an empty render, or a
# workload the chart stopped rendering, fails instead of passing over nothing).
SERVICE = "Deployment/elastrain"
ETCD = "StatefulSet/elastrain-etcd"
WORKLOADS = {
    "default": {SERVICE: ["service"], ETCD: ["etcd"]},
    "external-etcd": {SERVICE: ["service"]},
    "existing-claim": {SERVICE: ["service"], ETCD: ["etcd"]},
    "ingress": {SERVICE: ["service"], ETCD: ["etcd"]},
    "everything": {SERVICE: ["service"]},
}


def containers(spec: Obj) -> list[Obj]:
    return list(spec["containers"]) + list(spec.get("initContainers", []))


def test_the_scenarios_are_the_ones_checked() -> None:
    assert sorted(WORKLOADS) == sorted(SCENARIOS)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_pod_meets_the_restricted_profile(render: Renderer, scenario: str) -> None:
    pods = pod_specs(render(scenario))
    assert sorted(pods) == sorted(WORKLOADS[scenario])
    for name, spec in pods.items():
        assert restricted_violations(spec) == [], name


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_container_is_locked_down(render: Renderer, scenario: str) -> None:
    pods = pod_specs(render(scenario))
    seen = {name: [c["name"] for c in containers(spec)] for name, spec in pods.items()}
    assert seen == WORKLOADS[scenario], "the loop below must see every workload and container"
    for name, spec in pods.items():
        pod_sc = spec["securityContext"]
        assert pod_sc["runAsNonRoot"] is True, name
        assert pod_sc["runAsUser"] > 0 and pod_sc["runAsGroup"] > 0, name
        assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in containers(spec):
            sc = c["securityContext"]
            where = f"{name}/{c['name']}"
            assert sc["runAsNonRoot"] is True, where
            assert sc["allowPrivilegeEscalation"] is False, where
            assert sc["privileged"] is False, where
            assert sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"] == {"drop": ["ALL"]}, where
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, where
            tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]], (
                f"{where}: /tmp is not an emptyDir"
            )
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{where}: {kind}"


def test_service_writes_only_to_its_volumes(render: Renderer) -> None:
    spec = one(render(), "Deployment")["spec"]["template"]["spec"]
    mounts = {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts == {"/tmp", "/var/lib/elastrain", "/checkpoints", "/etc/elastrain/kube"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["data"]["emptyDir"]["sizeLimit"] == "1Gi"


def _service_accounts(objects: list[Obj]) -> dict[str, Obj]:
    return {sa["metadata"]["name"]: sa for sa in find(objects, "ServiceAccount")}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_only_the_service_gets_an_api_token(render: Renderer, scenario: str) -> None:
    objects = render(scenario)
    accounts = _service_accounts(objects)
    assert accounts["elastrain-worker"]["automountServiceAccountToken"] is False
    assert accounts["elastrain"]["automountServiceAccountToken"] is False  # opt-in per pod below
    pods = pod_specs(objects)
    assert pods["Deployment/elastrain"]["serviceAccountName"] == "elastrain"
    assert pods["Deployment/elastrain"]["automountServiceAccountToken"] is True
    for name, spec in pods.items():
        if name != "Deployment/elastrain":
            assert spec["automountServiceAccountToken"] is False, name
    env = {e["name"]: e for e in pods["Deployment/elastrain"]["containers"][0]["env"]}
    assert env["ELASTRAIN_K8S_SERVICE_ACCOUNT"]["value"] == "elastrain-worker"
    bound = [s for rb in find(objects, "RoleBinding") for s in rb["subjects"]]
    assert bound == [{"kind": "ServiceAccount", "name": "elastrain", "namespace": "elastrain"}]
    assert not find(objects, "ClusterRole") and not find(objects, "ClusterRoleBinding")


def test_restricted_check_catches_a_root_pod() -> None:
    """A control for the checker itself."""
    spec = {"containers": [{"name": "c", "securityContext": {}}], "volumes": [{"name": "h", "hostPath": {}}]}
    problems = restricted_violations(spec)
    assert "volume h uses ['hostPath']" in problems
    assert "container c: allowPrivilegeEscalation is not false" in problems
    assert "container c: runAsNonRoot is not true" in problems
