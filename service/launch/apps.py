"""Nodes as TorchX apps: one torchrun agent per node of a job, all sharing one rendezvous id.

Pure part (no I/O, no torch): :func:`node_app` turns (job, spec, node index) into a
``torchx.specs.AppDef`` whose single role runs::

    python -m torch.distributed.run --nnodes MIN:MAX --nproc-per-node P
        --rdzv-backend etcd-v3 --rdzv-endpoint ETCD --rdzv-id JOB --max-restarts R
        --rdzv-conf <service.rendezvous.config defaults> --module worker --config SPEC

with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torchrun's first-restart trap), ``ELASTRAIN_JOB_ID``
and ``ELASTRAIN_NODE_INDEX`` in its environment. :func:`kubernetes_dryrun` returns, as a plain
dict, the Volcano Job TorchX's ``kubernetes`` scheduler would submit for one node: what the Helm
chart's tests and ``elastrain`` users can inspect without a cluster (a stable, documented shape:
``spec.tasks[0].template`` is the worker pod; :func:`worker_pod` picks it out).

The I/O half, :class:`service.launch.torchx_scheduler.TorchXScheduler`, launches, watches and cancels
these apps through a TorchX runner (``local_cwd`` processes or ``kubernetes`` jobs).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torchx import specs

from service.rendezvous.config import RendezvousConfig, rdzv_conf_arg
from worker.errors import SpecError
from worker.spec import JobSpec, parse_nodes, spec_json

ROLE_NAME = "node"
SPEC_ENV = "ELASTRAIN_SPEC_JSON"
K8S_SPEC_PATH = "/tmp/elastrain/spec.json"
LAUNCH_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
_MEM_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
_MEM_RE = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|K|M|G)?$")
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
WORKER_UID = 10001  # deploy/docker/worker.Dockerfile's user and group


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulerSettings:
    """Where and how node apps run; the ``ELASTRAIN_*`` settings of the same names feed it."""

    scheduler: Literal["local_cwd", "kubernetes"] = "local_cwd"
    rdzv_endpoint: str
    """etcd client URL(s) the agents rendezvous through (``http://H:2379[,http://H2:2379]``)."""
    worker_image: str = ""
    """Container image of the worker (kubernetes); ignored by local_cwd."""
    k8s_namespace: str = "default"
    k8s_queue: str = "default"
    """Volcano queue (TorchX's kubernetes scheduler submits Volcano Jobs)."""
    k8s_service_account: str | None = None
    checkpoint_claim: str | None = None
    """PersistentVolumeClaim holding the checkpoints, mounted into every worker pod."""
    checkpoint_mount: str = "/checkpoints"
    log_root: str = ".elastrain/nodes"
    """local_cwd: each launch gets a directory under it (spec, logs, pid, exit code)."""
    python: str = "python"
    """The interpreter that runs torchrun (local_cwd passes ``sys.executable``)."""
    worker_module: str = "worker"
    """The module torchrun starts in each process (``python -m worker --config SPEC``)."""
    metrics_port: int | None = 9400
    """kubernetes: the worker container's Prometheus port (declared, annotated for scraping and
    passed as ``ELASTRAIN_METRICS_PORT``); ``None`` declares none."""
    rdzv: RendezvousConfig = field(default_factory=RendezvousConfig)

    def __post_init__(self) -> None:
        if not self.rdzv_endpoint.strip():
            raise SpecError("the scheduler needs the etcd endpoint(s) for the rendezvous (rdzv_endpoint)")
        if self.scheduler == "kubernetes" and not self.worker_image:
            raise SpecError("scheduler 'kubernetes' needs a worker image (ELASTRAIN_WORKER_IMAGE)")
        if not self.checkpoint_mount.startswith("/"):
            raise SpecError(f"checkpoint_mount {self.checkpoint_mount!r} must be an absolute path")

    @classmethod
    def from_settings(cls, settings: Any, **overrides: Any) -> SchedulerSettings:
        """From the service's ``Settings`` (read by attribute name; empty strings mean unset)."""
        endpoints = getattr(settings, "etcd_endpoints", None) or []
        values: dict[str, Any] = {
            "scheduler": settings.scheduler,
            "rdzv_endpoint": ",".join(endpoints),
            "worker_image": settings.worker_image,
            "k8s_namespace": settings.k8s_namespace or "default",
            "k8s_queue": settings.k8s_queue or "default",
            "k8s_service_account": settings.k8s_service_account or None,
            "checkpoint_claim": settings.checkpoint_claim or None,
            "checkpoint_mount": settings.checkpoint_mount,
        }
        values.update(overrides)
        return cls(**values)


def resource_from_spec(resources: Mapping[str, str]) -> specs.Resource:
    """``spec.resources`` -> a TorchX Resource. Keys: ``cpu`` (cores), ``gpu`` (count),
    ``memory`` (``"16Gi"``, ``"512Mi"``, bytes) or ``memMB``, ``instance_type``. Unset: no limit."""
    known = {"cpu", "gpu", "memory", "memMB", "instance_type"}
    unknown = sorted(set(resources) - known)
    if unknown:
        raise SpecError(f"resources: unknown key(s) {unknown}; known: {sorted(known)}")
    if "memory" in resources and "memMB" in resources:
        raise SpecError("resources: give 'memory' or 'memMB', not both")
    cpu = _count(resources, "cpu")
    gpu = _count(resources, "gpu")
    mem_mb = _count(resources, "memMB") if "memMB" in resources else _memory_mb(resources.get("memory"))
    capabilities = {INSTANCE_TYPE: resources["instance_type"]} if "instance_type" in resources else {}
    return specs.Resource(cpu=cpu, gpu=gpu, memMB=mem_mb, capabilities=capabilities)


def _count(resources: Mapping[str, str], key: str) -> int:
    if key not in resources:
        return -1
    try:
        value = int(resources[key])
    except ValueError:
        raise SpecError(f"resources.{key}={resources[key]!r}: give a whole number") from None
    if value < 0:
        raise SpecError(f"resources.{key}={value}: give 0 or more")
    return value


def _memory_mb(text: str | None) -> int:
    if text is None:
        return -1
    match = _MEM_RE.match(text.strip())
    if not match:
        raise SpecError(f"resources.memory={text!r}: give a size like '16Gi', '512Mi' or bytes")
    size = float(match.group(1)) * _MEM_UNITS.get(match.group(2) or "", 1)
    return max(int(size // 2**20), 1)


def torchrun_args(
    job_id: str,
    spec: JobSpec,
    *,
    rdzv_endpoint: str,
    spec_path: str,
    rdzv: RendezvousConfig,
    module: str = "worker",
) -> list[str]:
    """The arguments after ``python``: torchrun (as a module) running ``-m <module>``."""
    lo, hi = parse_nodes(spec.nodes)
    return [
        "-m", "torch.distributed.run",
        f"--nnodes={lo}:{hi}",
        f"--nproc-per-node={spec.nproc_per_node}",
        "--rdzv-backend=etcd-v3",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={job_id}",
        f"--max-restarts={spec.max_restarts}",
        f"--rdzv-conf={rdzv_conf_arg(rdzv)}",
        "--monitor-interval=0.1",
        "--module", module,
        "--config", spec_path,
    ]  # fmt: skip


def node_app(
    job_id: str,
    spec: JobSpec,
    node_index: int,
    *,
    rdzv_endpoint: str,
    image: str,
    env: Mapping[str, str],
    checkpoint_mount: str | None = None,
    checkpoint_claim: str | None = None,
    spec_path: str | None = None,
    python: str = "python",
    rdzv: RendezvousConfig | None = None,
    app_name: str | None = None,
    module: str = "worker",
) -> specs.AppDef:
    """The TorchX app of node ``node_index`` of ``job_id``: one replica running one torchrun agent.

    ``spec_path``: where the agent reads the spec; ``None`` ships the spec in the environment
    (``ELASTRAIN_SPEC_JSON``) and the command writes it to ``/tmp/elastrain/spec.json`` first
    (for containers, which share no files with the service). ``checkpoint_claim`` mounts that
    PersistentVolumeClaim at ``checkpoint_mount``. ``env`` is added last (the service's URL and
    the worker token go there); it cannot override the rendezvous variables. Pure.
    """
    if node_index < 0:
        raise SpecError(f"node index {node_index} must be 0 or more")
    if checkpoint_claim and not checkpoint_mount:
        raise SpecError("a checkpoint claim needs a mount path")
    config = rdzv or RendezvousConfig()
    path = spec_path or K8S_SPEC_PATH
    args = torchrun_args(
        job_id, spec, rdzv_endpoint=rdzv_endpoint, spec_path=path, rdzv=config, module=module
    )
    role_env = {
        **dict(env),
        **LAUNCH_ENV,
        "ELASTRAIN_JOB_ID": job_id,
        "ELASTRAIN_NODE_INDEX": str(node_index),
    }
    if spec_path is None:
        role_env[SPEC_ENV] = spec_json(spec)
        script = f'mkdir -p "$(dirname {path})" && printf "%s" "${SPEC_ENV}" > {path} && exec "$@"'
        entrypoint, args = "sh", ["-c", script, "sh", python, *args]
    else:
        entrypoint = python
    mounts: list[specs.BindMount | specs.VolumeMount | specs.DeviceMount] = []
    if checkpoint_claim and checkpoint_mount:
        mounts.append(specs.VolumeMount(src=checkpoint_claim, dst_path=checkpoint_mount))
    role = specs.Role(
        name=ROLE_NAME,
        image=image,
        entrypoint=entrypoint,
        args=args,
        env=role_env,
        num_replicas=1,
        max_retries=0,  # torchrun restarts the group; the reconciler replaces lost nodes
        resource=resource_from_spec(spec.resources),
        mounts=mounts,
    )
    return specs.AppDef(name=app_name or k8s_name(f"{job_id}-n{node_index}"), roles=[role])


def k8s_name(text: str, limit: int = 50) -> str:
    """A DNS-label-safe name (lowercase alphanumerics and '-'), short enough for TorchX's suffix."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")
    return name or "node"


def kubernetes_dryrun(
    job_id: str,
    spec: JobSpec,
    node_index: int,
    *,
    settings: SchedulerSettings,
    env: Mapping[str, str] | None = None,
    app_name: str | None = None,
) -> dict[str, Any]:
    """The Volcano Job (a plain, YAML-able dict) that TorchX's ``kubernetes`` scheduler would
    submit for node ``node_index``: ``metadata.namespace`` is the target namespace,
    ``spec.queue`` the Volcano queue and ``spec.tasks[0].template`` the worker pod (image,
    command, env, service account, resources, the checkpoint claim mounted at
    ``settings.checkpoint_mount``). No cluster needed. Stable shape; see :func:`worker_pod`."""
    from torchx.schedulers.kubernetes_scheduler import KubernetesScheduler

    app = node_app(
        job_id,
        spec,
        node_index,
        rdzv_endpoint=settings.rdzv_endpoint,
        image=settings.worker_image,
        env=env or {},
        checkpoint_mount=settings.checkpoint_mount,
        checkpoint_claim=settings.checkpoint_claim,
        rdzv=settings.rdzv,
        app_name=app_name,
        module=settings.worker_module,
    )
    info = KubernetesScheduler("elastrain").submit_dryrun(app, kubernetes_cfg(settings))
    return finish_volcano_job(info.request.resource, settings)


def finish_volcano_job(resource: Mapping[str, Any], settings: SchedulerSettings) -> dict[str, Any]:
    """TorchX's Volcano Job as a plain dict, with what TorchX 0.7.0 leaves out: the namespace,
    the restricted security profile and the metrics port (:func:`harden_pod`)."""
    from torchx.schedulers.kubernetes_scheduler import sanitize_for_serialization

    job = sanitize_for_serialization(resource)
    assert isinstance(job, dict)
    job["metadata"]["namespace"] = settings.k8s_namespace
    for task in job["spec"]["tasks"]:
        harden_pod(task["template"], metrics_port=settings.metrics_port)
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


def kubernetes_cfg(settings: SchedulerSettings) -> dict[str, specs.CfgVal]:
    cfg: dict[str, specs.CfgVal] = {"namespace": settings.k8s_namespace, "queue": settings.k8s_queue}
    if settings.k8s_service_account:
        cfg["service_account"] = settings.k8s_service_account
    return cfg


def worker_pod(volcano_job: Mapping[str, Any]) -> dict[str, Any]:
    """The pod template of a :func:`kubernetes_dryrun` result."""
    return dict(volcano_job["spec"]["tasks"][0]["template"])
