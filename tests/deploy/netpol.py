"""A pure evaluator of Kubernetes NetworkPolicy semantics, enough to ask "may A open a connection
to B on port P?" of a set of rendered policies: pod and namespace selectors (matchLabels and
matchExpressions), ipBlock with except, ports with protocol and endPort, policyTypes.

A flow is allowed when the source's egress allows it (or no policy selects the source for
Egress) and the destination's ingress allows it (or no policy selects it for Ingress). Endpoints
outside the cluster (the API server, an external etcd, the internet) are addresses."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

Policy = dict[str, Any]


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str] = field(default_factory=dict)
    ip: str = "10.0.0.1"
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


@dataclass(frozen=True)
class Address:
    ip: str


Endpoint = Pod | Address


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A LabelSelector; an empty one matches everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], other: Endpoint, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        ip = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        inside = ip in ipaddress.ip_network(block["cidr"])
        return inside and not any(ip in ipaddress.ip_network(e) for e in block.get("except") or [])
    if not isinstance(other, Pod):
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], other.ns_labels()):
            return False
    elif other.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], other.labels)


def _port_matches(entry: dict[str, Any], port: int, protocol: str) -> bool:
    if entry.get("protocol", "TCP") != protocol:
        return False
    if "port" not in entry:
        return True
    start = entry["port"]
    assert isinstance(start, int), f"named ports are not modelled: {entry}"
    end: int = entry.get("endPort", start)
    return bool(start <= port <= end)


def _rule_allows(
    rule: dict[str, Any], peers_key: str, other: Endpoint, port: int, protocol: str, ns: str
) -> bool:
    peers = rule.get(peers_key)
    if peers and not any(_peer_matches(p, other, ns) for p in peers):
        return False
    ports = rule.get("ports")
    return not ports or any(_port_matches(e, port, protocol) for e in ports)


def _selecting(policies: list[Policy], pod: Pod, direction: str) -> list[Policy]:
    return [
        p
        for p in policies
        if p["metadata"]["namespace"] == pod.namespace
        and direction in _policy_types(p)
        and selector_matches(p["spec"]["podSelector"], pod.labels)
    ]


def _policy_types(policy: Policy) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def egress_allowed(policies: list[Policy], src: Pod, dst: Endpoint, port: int, protocol: str) -> bool:
    selecting = _selecting(policies, src, "Egress")
    return not selecting or any(
        _rule_allows(rule, "to", dst, port, protocol, p["metadata"]["namespace"])
        for p in selecting
        for rule in p["spec"].get("egress") or []
    )


def ingress_allowed(policies: list[Policy], src: Endpoint, dst: Pod, port: int, protocol: str) -> bool:
    selecting = _selecting(policies, dst, "Ingress")
    return not selecting or any(
        _rule_allows(rule, "from", src, port, protocol, p["metadata"]["namespace"])
        for p in selecting
        for rule in p["spec"].get("ingress") or []
    )


def allowed(policies: list[Policy], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """Whether a connection from src to dst:port gets through both ends' policies."""
    if isinstance(src, Pod) and not egress_allowed(policies, src, dst, port, protocol):
        return False
    return not isinstance(dst, Pod) or ingress_allowed(policies, src, dst, port, protocol)
