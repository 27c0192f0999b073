"""The Kubernetes Pod Security Standards "restricted" profile (v1.27+) as a pure check on a pod
spec: what a namespace labelled pod-security.kubernetes.io/enforce=restricted would refuse."""

from __future__ import annotations

from typing import Any

Spec = dict[str, Any]

_ALLOWED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
_ALLOWED_ADD_CAPABILITIES = {"NET_BIND_SERVICE"}
_ALLOWED_SECCOMP = {"RuntimeDefault", "Localhost"}


def restricted_violations(spec: Spec) -> list[str]:
    """Every rule of the restricted profile the pod spec breaks (empty when it is admitted)."""
    problems: list[str] = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            problems.append(f"{key} is true")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= _ALLOWED_VOLUMES:
            problems.append(f"volume {volume['name']} uses {sorted(kinds - _ALLOWED_VOLUMES)}")
    pod_sc = spec.get("securityContext") or {}
    if pod_sc.get("runAsUser") == 0:
        problems.append("pod runAsUser is 0")
    containers = (spec.get("initContainers") or []) + (spec.get("containers") or [])
    for c in containers:
        problems += [f"container {c['name']}: {p}" for p in _container_violations(c, pod_sc)]
    return problems


def _container_violations(container: Spec, pod_sc: Spec) -> list[str]:
    sc = container.get("securityContext") or {}
    problems = []
    if sc.get("privileged"):
        problems.append("privileged")
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation is not false")
    caps = sc.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        problems.append("capabilities do not drop ALL")
    if not set(caps.get("add") or []) <= _ALLOWED_ADD_CAPABILITIES:
        problems.append(f"capabilities add {caps.get('add')}")
    if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
        problems.append("runAsNonRoot is not true")
    if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
        problems.append("runAsUser is 0")
    seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    if seccomp not in _ALLOWED_SECCOMP:
        problems.append(f"seccompProfile type is {seccomp}")
    for port in container.get("ports") or []:
        if port.get("hostPort"):
            problems.append(f"hostPort {port['hostPort']}")
    return problems
