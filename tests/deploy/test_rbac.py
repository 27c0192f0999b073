"""The service's Role holds exactly the verbs its Kubernetes calls need: derived from the installed
TorchX kubernetes scheduler's source (and service/, should it call the API itself), not copied."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torchx.schedulers.kubernetes_scheduler as k8s_scheduler
import yaml

from scripts.deploy_tools import REPO_ROOT
from tests.deploy.helpers import SCENARIOS, Obj, Renderer, one

Permission = tuple[str, str, str]  # (apiGroup, resource, verb)

# kubernetes-client method -> (resource suffix, verb). Custom-object methods take group/plural.
_CUSTOM_OBJECT_METHODS = {
    "create_namespaced_custom_object": ("", "create"),
    "delete_namespaced_custom_object": ("", "delete"),
    "get_namespaced_custom_object": ("", "get"),
    "get_namespaced_custom_object_status": ("/status", "get"),
    "list_namespaced_custom_object": ("", "list"),
    "patch_namespaced_custom_object": ("", "patch"),
    "patch_namespaced_custom_object_status": ("/status", "patch"),
    "replace_namespaced_custom_object": ("", "update"),
}
_CORE_METHODS: dict[str, Permission] = {
    "read_namespaced_pod_log": ("", "pods/log", "get"),
    "read_namespaced_pod": ("", "pods", "get"),
    "list_namespaced_pod": ("", "pods", "list"),
    "delete_namespaced_pod": ("", "pods", "delete"),
    "list_namespaced_event": ("", "events", "list"),
}


def api_permissions(source: str, origin: str) -> set[Permission]:
    """The (group, resource, verb) triples a module's Kubernetes client calls need.

    Fails on a client method it does not know, so a new call cannot slip past the Role."""
    needed: set[Permission] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method = node.func.attr
            if method in _CUSTOM_OBJECT_METHODS:
                kwargs = {k.arg: k.value for k in node.keywords}
                group, plural = kwargs.get("group"), kwargs.get("plural")
                where = f"{origin}:{node.lineno}: {method} with a computed group/plural; extend this test"
                assert isinstance(group, ast.Constant) and isinstance(plural, ast.Constant), where
                assert isinstance(group.value, str) and isinstance(plural.value, str), where
                suffix, verb = _CUSTOM_OBJECT_METHODS[method]
                needed.add((group.value, plural.value + suffix, verb))
        if isinstance(node, ast.Attribute) and "_namespaced_" in node.attr:
            if node.attr in _CORE_METHODS:
                needed.add(_CORE_METHODS[node.attr])
            elif node.attr not in _CUSTOM_OBJECT_METHODS:
                pytest.fail(f"{origin}:{node.lineno} calls {node.attr}: add it to the Role and to this test")
    return needed


def _service_sources() -> list[Path]:
    return sorted((REPO_ROOT / "service").rglob("*.py"))


def needed_permissions() -> set[Permission]:
    path = Path(k8s_scheduler.__file__)
    needed = api_permissions(path.read_text(), f"torchx/{path.name}")
    for source in _service_sources():
        needed |= api_permissions(source.read_text(), str(source.relative_to(REPO_ROOT)))
    return needed


def granted(role: Obj) -> set[Permission]:
    out = set()
    for rule in role["rules"]:
        assert "resourceNames" not in rule and "nonResourceURLs" not in rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {rule}"
                    out.add((group, resource, verb))
    return out


def test_torchx_needs_what_the_chart_documents() -> None:
    """Pins what this TorchX version calls (an upgrade that changes it shows up here)."""
    path = Path(k8s_scheduler.__file__)
    assert api_permissions(path.read_text(), path.name) == {
        ("batch.volcano.sh", "jobs", "create"),
        ("batch.volcano.sh", "jobs", "delete"),
        ("batch.volcano.sh", "jobs", "list"),
        ("batch.volcano.sh", "jobs/status", "get"),
        ("", "pods/log", "get"),
    }


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_role_grants_exactly_what_is_called(render: Renderer, scenario: str) -> None:
    objects = render(scenario)
    role = one(objects, "Role")
    assert granted(role) == needed_permissions()
    binding = one(objects, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }


def test_an_unknown_client_call_is_refused() -> None:
    """A control: a call the map does not know fails instead of passing silently."""
    with pytest.raises(pytest.fail.Exception, match="patch_namespaced_pod"):
        api_permissions("api.patch_namespaced_pod(name='x', namespace='y', body={})", "example.py")


def test_kubeconfig_gives_torchx_an_in_cluster_client(render: Renderer, tmp_path: Path) -> None:
    """TorchX calls load_kube_config(); the chart's kubeconfig, read by the real client library,
    yields a client for the in-cluster API server that sends the pod's ServiceAccount token."""
    from kubernetes import client
    from kubernetes.config.kube_config import KubeConfigLoader

    objects = render()
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    mount = next(
        m for m in pod["containers"][0]["volumeMounts"] if env["KUBECONFIG"].startswith(m["mountPath"])
    )
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = one(objects, "ConfigMap", volume["configMap"]["name"])
    kubeconfig = yaml.safe_load(config_map["data"][env["KUBECONFIG"].removeprefix(mount["mountPath"] + "/")])
    # Stand-ins for the files the kubelet mounts at /var/run/secrets/kubernetes.io/serviceaccount.
    sa_dir = "/var/run/secrets/kubernetes.io/serviceaccount"
    (tmp_path / "token").write_text("sa-token-123")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    text = yaml.safe_dump(kubeconfig).replace(sa_dir, str(tmp_path))
    configuration = client.Configuration()
    KubeConfigLoader(config_dict=yaml.safe_load(text)).load_and_set(configuration)
    assert configuration.host == "https://kubernetes.default.svc"
    assert configuration.api_key["authorization"] == "Bearer sa-token-123"
    assert configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert kubeconfig["contexts"][0]["context"]["namespace"] == "elastrain"
