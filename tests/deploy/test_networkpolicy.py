"""The NetworkPolicies, asked flow by flow: what must get through gets through, and the rest
(anything not listed in the issue) is denied."""

from __future__ import annotations

import pytest

from tests.deploy.helpers import NAMESPACE, Obj, Renderer, chart_values, find, one
from tests.deploy.netpol import Address, Endpoint, Pod, allowed

NS = NAMESPACE


def _labels(objects: list[Obj], kind: str, name: str) -> dict[str, str]:
    labels: dict[str, str] = one(objects, kind, name)["spec"]["template"]["metadata"]["labels"]
    return labels


def _worker(index: int) -> Pod:
    """A worker pod as TorchX labels it (app name, replica...) plus the chart's worker labels."""
    labels = {
        "app.kubernetes.io/name": "job-abc",
        "app.kubernetes.io/instance": f"job-abc-{index}",
        "torchx.pytorch.org/replica-id": str(index),
        **chart_values()["workers"]["selectorLabels"],
    }
    return Pod(NS, labels, ip=f"10.1.0.{index + 10}")


CLIENT = Pod(NS, {"app": "notebook"}, ip="10.1.1.1")
OTHER_NS_CLIENT = Pod("team-b", {"app": "notebook"}, ip="10.2.1.1")
PROMETHEUS = Pod("monitoring", {"app.kubernetes.io/name": "prometheus"}, ip="10.3.0.5")
KUBE_DNS = Pod("kube-system", {"k8s-app": "kube-dns"}, ip="10.96.0.10")
INGRESS_NGINX = Pod("ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}, ip="10.4.0.2")
KUBE_API = Address("172.20.0.1")
INTERNET = Address("93.184.216.34")


def _cast(objects: list[Obj]) -> dict[str, Pod]:
    cast = {
        "service": Pod(NS, _labels(objects, "Deployment", "elastrain"), ip="10.1.2.1"),
        "service1": Pod(NS, _labels(objects, "Deployment", "elastrain"), ip="10.1.2.2"),  # a replica
        "worker0": _worker(0),
        "worker1": _worker(1),
    }
    if find(objects, "StatefulSet"):
        etcd = _labels(objects, "StatefulSet", "elastrain-etcd")
        cast["etcd0"] = Pod(NS, etcd, ip="10.1.3.1")
        cast["etcd1"] = Pod(NS, etcd, ip="10.1.3.2")
    return cast


def _policies(objects: list[Obj]) -> list[Obj]:
    return find(objects, "NetworkPolicy")


def test_every_chart_pod_and_worker_is_isolated_both_ways(render: Renderer) -> None:
    objects = render()
    cast = _cast(objects)
    for name, pod in cast.items():
        # An unknown pod in the namespace reaches nothing on an unlisted port, and vice versa.
        assert not allowed(_policies(objects), CLIENT, pod, 31337), name
        assert not allowed(_policies(objects), pod, INTERNET, 8443), name
        if not name.startswith("service"):  # the API server is not a pod: see the next test
            assert not allowed(_policies(objects), pod, INTERNET, 443), name


def test_api_server_egress_narrows_to_given_peers(render: Renderer) -> None:
    """By default the service may open 443/6443 anywhere (the API server has no pod labels to
    select); networkPolicy.kubeApiServer.peers narrows that to the API server's addresses."""
    objects = render()
    service = _cast(objects)["service"]
    assert allowed(_policies(objects), service, INTERNET, 443)
    objects = render(set_values=("networkPolicy.kubeApiServer.peers[0].ipBlock.cidr=172.20.0.1/32",))
    assert allowed(_policies(objects), service, KUBE_API, 443)
    assert not allowed(_policies(objects), service, INTERNET, 443)


def test_required_flows_get_through(render: Renderer) -> None:
    objects = render()
    p, c = _policies(objects), _cast(objects)
    must: list[tuple[Endpoint, Endpoint, int, str]] = [
        (CLIENT, c["service"], 8080, "clients -> REST API"),
        (c["service1"], c["service"], 8080, "standby -> leader (forwarded writes)"),
        (c["worker0"], c["service"], 8081, "workers -> the service's workers' port (resume, shard reports)"),
        (c["service"], c["etcd0"], 2379, "service -> etcd"),
        (c["etcd0"], c["etcd1"], 2380, "etcd peers"),
        (c["worker0"], c["worker1"], 29500, "c10d store"),
        (c["worker1"], c["worker0"], 43127, "gloo/NCCL ephemeral ports"),
        (c["service"], KUBE_API, 443, "service -> Kubernetes API"),
        (c["service"], KUBE_API, 6443, "service -> Kubernetes API (6443)"),
        (PROMETHEUS, c["service"], 8080, "Prometheus -> service /metrics"),
        (PROMETHEUS, c["worker0"], 9400, "Prometheus -> worker /metrics"),
        (PROMETHEUS, c["etcd0"], 2381, "Prometheus -> etcd /metrics"),
    ]
    for src, dst, port, what in must:
        assert allowed(p, src, dst, port), what
    for pod in c.values():
        assert allowed(p, pod, KUBE_DNS, 53, "UDP") and allowed(p, pod, KUBE_DNS, 53, "TCP")


def test_everything_else_is_denied(render: Renderer) -> None:
    objects = render()
    p, c = _policies(objects), _cast(objects)
    must_not: list[tuple[Endpoint, Endpoint, int, str]] = [
        (CLIENT, c["etcd0"], 2379, "clients -> etcd"),
        (CLIENT, c["worker0"], 29500, "clients -> workers"),
        (OTHER_NS_CLIENT, c["service"], 8080, "another namespace -> REST API"),
        (INGRESS_NGINX, c["service"], 8080, "ingress controller while ingress is off"),
        (c["worker0"], KUBE_API, 443, "workers -> Kubernetes API"),
        (c["worker0"], INTERNET, 443, "workers -> internet"),
        (c["worker0"], c["etcd0"], 2379, "workers -> etcd client port (job code is untrusted)"),
        (c["worker0"], c["etcd0"], 2380, "workers -> etcd peer port"),
        (c["worker0"], c["etcd0"], 2381, "workers -> etcd metrics"),
        (c["worker0"], c["service"], 9400, "workers -> the service off its workers' port"),
        (c["worker0"], c["service"], 8080, "workers -> the users' API port (they call their own)"),
        (c["service"], c["worker0"], 29500, "service -> workers"),
        (c["service1"], c["service"], 9400, "standby -> leader, off the API port"),
        (c["service"], INTERNET, 80, "service -> internet"),
        (c["etcd0"], c["service"], 8080, "etcd -> service"),
        (c["etcd0"], INTERNET, 443, "etcd -> internet"),
        (PROMETHEUS, c["worker0"], 29500, "Prometheus -> c10d store"),
        (PROMETHEUS, c["etcd0"], 2379, "Prometheus -> etcd client port"),
        (c["worker0"], c["worker1"], 4791, "UDP between workers"),
    ]
    for src, dst, port, what in must_not:
        protocol = "UDP" if "UDP" in what else "TCP"
        assert not allowed(p, src, dst, port, protocol), what


def test_ingress_controller_admitted_only_with_ingress(render: Renderer) -> None:
    objects = render("ingress")
    service = _cast(objects)["service"]
    assert allowed(_policies(objects), INGRESS_NGINX, service, 8080)
    assert not allowed(_policies(objects), INGRESS_NGINX, service, 2379)


def test_external_etcd_reached_on_its_ports_only(render: Renderer) -> None:
    objects = render("external-etcd")
    p, c = _policies(objects), _cast(objects)
    etcd = Address("10.20.3.4")  # inside the ipBlock of tests/deploy/values/external-etcd.yaml
    service = c["service"]
    assert allowed(p, service, etcd, 2379) and allowed(p, service, etcd, 12379)
    assert not allowed(p, service, etcd, 2380)
    assert not allowed(p, service, Address("10.30.0.1"), 2379)  # outside the ipBlock
    assert not any(allowed(p, c["worker0"], etcd, port) for port in (2379, 12379))  # job code never


def test_namespace_default_deny_is_opt_in(render: Renderer) -> None:
    bystander = Pod(NS, {"app": "unrelated"})
    assert allowed(_policies(render()), CLIENT, bystander, 80)
    objects = render(set_values=("networkPolicy.namespaceDefaultDeny=true",))
    p, c = _policies(objects), _cast(objects)
    assert not allowed(p, CLIENT, bystander, 80)
    # Other pods of the namespace now need their own egress policy to call the API...
    assert not allowed(p, CLIENT, c["service"], 8080)
    # ...while the release's own flows are unchanged.
    assert allowed(p, c["worker0"], c["service"], 8081)
    assert allowed(p, PROMETHEUS, c["worker0"], 9400)


def test_network_policy_can_be_turned_off(render: Renderer) -> None:
    assert not find(render(set_values=("networkPolicy.enabled=false",)), "NetworkPolicy")


@pytest.mark.parametrize(
    ("policy_ports", "port", "protocol", "expected"),
    [
        ([{"protocol": "TCP"}], 1234, "TCP", True),
        ([{"protocol": "TCP"}], 1234, "UDP", False),
        ([{"port": 2379}], 2379, "TCP", True),
        ([{"port": 30000, "endPort": 32767}], 31000, "TCP", True),
        ([{"port": 30000, "endPort": 32767}], 40000, "TCP", False),
    ],
)
def test_evaluator_port_semantics(policy_ports: list[Obj], port: int, protocol: str, expected: bool) -> None:
    """Controls for the evaluator itself."""
    policy = {
        "metadata": {"namespace": NS},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"ports": policy_ports}]},
    }
    assert allowed([policy], CLIENT, Pod(NS, {}), port, protocol) is expected
    assert allowed([], CLIENT, Pod(NS, {}), port, protocol) is True  # no policy: open
