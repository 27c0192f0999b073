"""Plan, then apply: what launching one node will do, as a value, before anything is started.

:meth:`service.launch.torchx_scheduler.TorchXScheduler.dryrun` returns a :class:`LocalLaunch`
(``local_cwd``: the node directory, the spec file and its text, the log directory, and TorchX's
request, which holds the exact command and environment of the process) or a
:class:`KubernetesLaunch` (the Volcano Job); :meth:`~.TorchXScheduler.schedule` performs exactly
that value, and ``launch`` is the two in a row.

:func:`kubernetes_dryrun` is the Volcano Job (a plain, YAML-able dict) TorchX's ``kubernetes``
scheduler submits for one node, named by its launch id: what the Helm chart's tests and
``elastrain`` users can inspect without a cluster, and what the scheduler submits (a stable,
documented shape: ``spec.tasks[0].template`` is the worker pod; :func:`worker_pod` picks it out).
:func:`kubernetes_gang_dryrun` is the one Volcano Job that starts a job's minimum nodes together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchx import specs
from torchx.specs import AppDryRunInfo

from service.jobs.objectstore import SECRET_VARS, uses_object_storage
from service.launch import threads
from service.launch.apps import (
    NODE_ADDR_ENV,
    SchedulerSettings,
    k8s_name,
    node_app,
    termination_grace_seconds,
)
from service.launch.protocol import NodeLaunch
from worker.jobspec.spec import JobSpec

KUBERNETES = "kubernetes"
WORKER_UID = 10001  # deploy/docker/worker.Dockerfile's user and group
LOCAL = "local_cwd"


@dataclass(frozen=True)
class LocalLaunch:
    """What launching one node on this machine will do: create ``node_dir``, write ``spec_json``
    to ``spec_path``, then start TorchX's ``request`` (the node wrapper running torchrun), with
    its logs under ``log_dir``. ``handle`` names the node from then on."""

    handle: str
    node_dir: Path
    spec_path: Path
    spec_json: str
    log_dir: Path
    request: AppDryRunInfo[Any]

    @property
    def command(self) -> list[str]:
        """The process the node is (the wrapper, then torchrun and its arguments)."""
        return list(self._replica().args)

    @property
    def env(self) -> dict[str, str]:
        return dict(self._replica().env)

    def _replica(self) -> Any:
        (replicas,) = self.request.request.role_params.values()
        return replicas[0]


@dataclass(frozen=True)
class KubernetesLaunch:
    """What launching one node on a cluster will do: submit ``volcano_job`` (see
    :func:`kubernetes_dryrun`) through TorchX's ``request``."""

    request: AppDryRunInfo[Any]

    @property
    def volcano_job(self) -> dict[str, Any]:
        job: dict[str, Any] = self.request.request.resource
        return job

    @property
    def name(self) -> str:
        return str(self.volcano_job["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.volcano_job["metadata"]["namespace"])


def kubernetes_request(node: NodeLaunch, settings: SchedulerSettings) -> AppDryRunInfo[Any]:
    """TorchX's dry run of one node on ``kubernetes``, finished (:func:`finish_volcano_job`) and
    named by its launch id (so a second launch of the same id is refused by the cluster as a
    duplicate, never run twice). No cluster needed. Pure."""
    return _volcano_request([node], settings, name=k8s_name(node.launch_id, limit=63))


def kubernetes_gang_request(nodes: Sequence[NodeLaunch], settings: SchedulerSettings) -> AppDryRunInfo[Any]:
    """TorchX's dry run of a job's minimum as one gang: one Volcano Job whose tasks are the
    ``nodes`` (one pod each, task ``n<index>-0``), named by the first node's launch id. Each node
    is a TorchX role with ``min_replicas=1``, which TorchX turns into the task's
    ``minAvailable: 1``; Volcano's admission sets the Job's ``minAvailable`` to their sum, so no
    pod of the gang starts until all of them can. Pure."""
    if not nodes:
        raise ValueError("a gang needs at least one node")
    return _volcano_request(nodes, settings, name=k8s_name(f"{nodes[0].launch_id}-gang", limit=63))


def gang_role(node_index: int) -> str:
    """The TorchX role (and, with ``-0``, the Volcano task) of node ``node_index`` in a gang."""
    return f"n{node_index}"


def _volcano_request(
    nodes: Sequence[NodeLaunch], settings: SchedulerSettings, *, name: str
) -> AppDryRunInfo[Any]:
    from torchx.schedulers.kubernetes_scheduler import KubernetesScheduler

    roles, app_names = [], []
    for node in nodes:
        share = threads.kubernetes(node.spec).env(node.spec)
        app = node_app(
            dataclasses.replace(node, env={**share, **node.env}),
            rdzv_endpoint=settings.rdzv_endpoint,
            image=node.spec.image or settings.worker_image,  # a team's image, built FROM the worker's
            checkpoint_mount=settings.checkpoint_mount,
            checkpoint_claim=settings.checkpoint_claim,
            rdzv=settings.rdzv,
            module=settings.worker_module,
        )
        role = app.roles[0]
        role.min_replicas = 1  # TorchX: the task's minAvailable; Volcano: the Job's is their sum
        if len(nodes) > 1:
            role.name = gang_role(node.node_index)
        roles.append(role)
        app_names.append(app.name)
    spec = nodes[0].spec
    app_name = app_names[0] if len(nodes) == 1 else k8s_name(f"{spec.name}-gang")
    app = specs.AppDef(name=app_name, roles=roles)
    info = KubernetesScheduler("elastrain").submit_dryrun(app, kubernetes_cfg(settings, spec))
    job = finish_volcano_job(info.request.resource, settings, name=name)
    for task in job["spec"]["tasks"]:
        # an eviction's SIGTERM reaches torchrun (the container's first process) and its workers
        # save; the kubelet's SIGKILL waits for the job's grace period
        task["template"]["spec"]["terminationGracePeriodSeconds"] = termination_grace_seconds(spec)
        if nodes[0].recovery == "peer":
            give_pod_ip(task["template"])
        if uses_object_storage(node.spec.checkpoint.dir, node.spec.checkpoint.resume):
            give_storage_secret(task["template"], settings.storage_secret)
    info.request.resource = job
    info._scheduler = KUBERNETES  # what TorchX's Runner.schedule dispatches on
    return info


def kubernetes_dryrun(node: NodeLaunch, settings: SchedulerSettings) -> dict[str, Any]:
    """The Volcano Job TorchX's ``kubernetes`` scheduler submits for ``node``:
    ``metadata.namespace`` is the target namespace, ``metadata.name`` the launch id,
    ``spec.queue`` the Volcano queue (the spec's ``queue``, else the service's),
    ``spec.priorityClassName`` the PriorityClass of the spec's ``priority`` (when not 0),
    ``spec.tasks[0].minAvailable`` 1 and ``spec.tasks[0].template`` the worker pod (image,
    command, env, service account, resources, the checkpoint claim mounted at
    ``settings.checkpoint_mount``; in peer mode ``ELASTRAIN_NODE_ADDR`` from the pod's IP). No
    etcd endpoint, credential or TLS file: the rendezvous goes through the service's gateway.
    Pure; see :func:`worker_pod`."""
    job: dict[str, Any] = kubernetes_request(node, settings).request.resource
    return job


def kubernetes_gang_dryrun(nodes: Sequence[NodeLaunch], settings: SchedulerSettings) -> dict[str, Any]:
    """The Volcano Job that starts a job's minimum ``nodes`` together
    (:func:`kubernetes_gang_request`): as :func:`kubernetes_dryrun`, with one task per node, each
    ``minAvailable: 1`` (:func:`gang_min_available` is the gang's size). Pure."""
    job: dict[str, Any] = kubernetes_gang_request(nodes, settings).request.resource
    return job


def gang_min_available(volcano_job: Mapping[str, Any]) -> int:
    """The pods Volcano must place at once before any of ``volcano_job`` starts: its
    ``spec.minAvailable`` when set, else (as Volcano's admission fills it in) the sum of its
    tasks' ``minAvailable``, a task without one counting its replicas."""
    spec = volcano_job["spec"]
    if spec.get("minAvailable"):
        return int(spec["minAvailable"])
    return sum(int(task.get("minAvailable", task["replicas"])) for task in spec["tasks"])


def finish_volcano_job(
    resource: Mapping[str, Any], settings: SchedulerSettings, *, name: str | None = None
) -> dict[str, Any]:
    """TorchX's Volcano Job as a plain dict, with what TorchX 0.7.0 leaves out: the namespace,
    the restricted security profile and the metrics port (:func:`harden_pod`). ``name``
    replaces TorchX's random one (the job's name and its pods' instance label)."""
    from torchx.schedulers.kubernetes_scheduler import LABEL_UNIQUE_NAME, sanitize_for_serialization

    job = sanitize_for_serialization(resource)
    assert isinstance(job, dict)
    job["metadata"]["namespace"] = settings.k8s_namespace
    if name is not None:
        job["metadata"]["name"] = name
    for task in job["spec"]["tasks"]:
        harden_pod(task["template"], metrics_port=settings.metrics_port)
        if name is not None:
            task["template"]["metadata"]["labels"][LABEL_UNIQUE_NAME] = name
    return job


def harden_pod(pod: dict[str, Any], *, metrics_port: int | None) -> None:
    """Make a worker pod pass the ``restricted`` Pod Security Standard (non-root as the worker
    image's user 10001, no privilege escalation, all capabilities dropped, RuntimeDefault
    seccomp, no API token), give it a writable ``/tmp`` and declare its metrics port. In place."""
    spec = pod["spec"]
    spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": WORKER_UID,
        "runAsGroup": WORKER_UID,
        "fsGroup": WORKER_UID,  # the checkpoint volume is writable by the worker
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    spec["automountServiceAccountToken"] = False
    spec.setdefault("volumes", []).append({"name": "tmp", "emptyDir": {}})
    for container in spec["containers"]:
        container["securityContext"] = {
            "allowPrivilegeEscalation": False,
            "privileged": False,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        }
        container.setdefault("volumeMounts", []).append({"name": "tmp", "mountPath": "/tmp"})
        if metrics_port is not None:
            container["ports"] = [{"name": "metrics", "containerPort": metrics_port}]
            container.setdefault("env", []).append(
                {"name": "ELASTRAIN_METRICS_PORT", "value": str(metrics_port)}
            )
    if metrics_port is not None:
        annotations = pod.setdefault("metadata", {}).setdefault("annotations", {})
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port)})


def give_pod_ip(pod: dict[str, Any]) -> None:
    """Tell a peer-mode worker the address the other workers reach it at: ``ELASTRAIN_NODE_ADDR``
    from the pod's own IP (the downward API; TorchX's env takes plain strings only). In place."""
    for container in pod["spec"]["containers"]:
        env = container.setdefault("env", [])
        env[:] = [e for e in env if e.get("name") != NODE_ADDR_ENV]
        env.append({"name": NODE_ADDR_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})


def give_storage_secret(pod: dict[str, Any], secret: str | None) -> None:
    """Give a worker pod of a job on ``s3://`` the service's storage credentials from the Secret
    ``secret`` (``secretKeyRef``: never a plain value in the pod spec; ``AWS_SESSION_TOKEN``
    optional). Where the store is (``AWS_ENDPOINT_URL``...) the service puts in the env itself.
    No Secret: the pod resolves its own credentials (IAM roles for service accounts through the
    workers' ServiceAccount, or the node's role) and nothing is added. In place."""
    if not secret:
        return
    refs = [
        {
            "name": n,
            "valueFrom": {"secretKeyRef": {"name": secret, "key": n, "optional": n == "AWS_SESSION_TOKEN"}},
        }
        for n in SECRET_VARS
    ]
    for container in pod["spec"]["containers"]:
        env = container.setdefault("env", [])
        env[:] = [e for e in env if e.get("name") not in SECRET_VARS] + refs


def kubernetes_cfg(settings: SchedulerSettings, spec: JobSpec | None = None) -> dict[str, specs.CfgVal]:
    """TorchX's run options for ``kubernetes`` from the settings and the job's spec: the Volcano
    queue (the spec's ``queue``, else the service's) and the PriorityClass of its ``priority``
    (:func:`priority_class`; none for 0, the cluster's default)."""
    queue = spec.queue if spec is not None and spec.queue else settings.k8s_queue
    cfg: dict[str, specs.CfgVal] = {"namespace": settings.k8s_namespace, "queue": queue}
    if settings.k8s_service_account:
        cfg["service_account"] = settings.k8s_service_account
    name = priority_class(spec.priority) if spec is not None else None
    if name is not None:
        cfg["priority_class"] = name
    return cfg


def priority_class(priority: int) -> str | None:
    """The PriorityClass a job of ``priority`` runs under: ``elastrain-priority-<N>`` (negative:
    ``elastrain-priority-minus-<N>``), None for 0. The cluster must have it (the chart's README
    says how to create it); Volcano orders the jobs of a queue by it."""
    if priority == 0:
        return None
    return f"elastrain-priority-{'minus-' if priority < 0 else ''}{abs(priority)}"


def worker_pod(volcano_job: Mapping[str, Any]) -> dict[str, Any]:
    """The pod template of a :func:`kubernetes_dryrun` result."""
    return dict(volcano_job["spec"]["tasks"][0]["template"])
