"""Nodes as TorchX apps: one torchrun agent per node of a job.

Pure (no I/O, no torch): :func:`node_app` turns one :class:`~service.launch.protocol.NodeLaunch`
into a ``torchx.specs.AppDef`` whose single role runs, in restart mode (all agents of a job in
one rendezvous; torchrun restarts the whole group on a failure)::

    python -m torch.distributed.run --nnodes MIN:MAX --nproc-per-node P
        --rdzv-backend etcd-v3 --rdzv-endpoint GATEWAY --rdzv-id JOB --max-restarts R
        --rdzv-conf <service.rendezvous.config defaults> --module worker --config SPEC

and in peer mode (each agent has a private one-node rendezvous, so torchrun's restart on
a membership change can never stop the survivors; the workers form the job's group themselves)::

    python -m torch.distributed.run --standalone --nnodes 1:1 --nproc-per-node P
        --max-restarts R --monitor-interval 0.1 --module worker --config SPEC

with the environment of :func:`node_env`, the one place that says what a node is told:
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (torchrun's first-restart trap), ``ELASTRAIN_JOB_ID``,
``ELASTRAIN_NODE_INDEX`` and ``ELASTRAIN_LAUNCH_ID``, in peer mode ``ELASTRAIN_RECOVERY=peer`` and
``ELASTRAIN_ROLE`` (``member`` or ``spare``), over what the service adds (its URL, the worker
token, the checkpoint directory and the job's key-value gateway, which is also the
``--rdzv-endpoint``: a job is given no etcd endpoint or credential). On Kubernetes a
peer-mode pod also gets ``ELASTRAIN_NODE_ADDR``, its own IP (:mod:`service.launch.dryrun`); on
one machine the worker finds its address itself. :func:`local_node_app` wraps the app for one
machine. What a launch will submit, as a value, is :mod:`service.launch.dryrun`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torchx import specs

from service.jobs.resources import parse_resources
from service.launch import gpus, threads
from service.launch.protocol import NodeLaunch
from service.rendezvous.config import RendezvousConfig, rdzv_conf_arg
from worker.errors import SpecError
from worker.etcdclient import GATEWAY_ENV
from worker.jobspec.spec import JobSpec, parse_nodes, spec_json

ROLE_NAME = "node"
SPEC_ENV = "ELASTRAIN_SPEC_JSON"
K8S_SPEC_PATH = "/tmp/elastrain/spec.json"
LAUNCH_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
RECOVERY_ENV, ROLE_ENV, NODE_ADDR_ENV = "ELASTRAIN_RECOVERY", "ELASTRAIN_ROLE", "ELASTRAIN_NODE_ADDR"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"


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
    storage_secret: str | None = None
    """kubernetes: the Secret whose ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` (and, if it
    has one, ``AWS_SESSION_TOKEN``) the worker pods of a job on ``s3://`` get (``secretKeyRef``)."""
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
    host_gpus: int = 0
    """local_cwd: the GPUs this machine's nodes would see (the caller reads them:
    :func:`service.launch.hostgpus.host_gpus`);
    a job of several node apps has them hidden (:func:`service.launch.gpus.hide`)."""
    host_cores: int = 1
    local_slots: int = 1
    """local_cwd: this host's cores and the worker processes the service runs on it at once
    (:func:`service.launch.threads.local` gives each process its share)."""

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
            "storage_secret": getattr(settings, "storage_secret", "") or None,
        }
        values.update(overrides)
        return cls(**values)


def resource_from_spec(resources: Mapping[str, str]) -> specs.Resource:
    """``spec.resources`` (read by :func:`service.jobs.resources.parse_resources`, which the
    submit checks too) -> a TorchX Resource."""
    parsed = parse_resources(resources)
    capabilities = {INSTANCE_TYPE: parsed.instance_type} if parsed.instance_type else {}
    return specs.Resource(cpu=parsed.cpu, gpu=parsed.gpu, memMB=parsed.mem_mb, capabilities=capabilities)


def shutdown_timeout(spec: JobSpec) -> int:
    """torchrun's wait for its workers after it forwarded a SIGTERM, before its SIGKILL: the
    job's grace period (``preemption.grace_s``, rounded up), so that a save that fits the grace
    is not cut short. Pure."""
    return math.ceil(spec.preemption.grace_s)


TERMINATION_MARGIN_S = 5
"""What a worker pod's grace period adds to the job's ``preemption.grace_s``: torchrun's own
exit after its workers' (its SIGKILL fires at ``grace_s``), and the kubelet's slack."""


def termination_grace_seconds(spec: JobSpec) -> int:
    """A worker pod's ``terminationGracePeriodSeconds``: the kubelet's SIGKILL comes after the
    workers' graceful stop had its ``preemption.grace_s``. Pure."""
    return shutdown_timeout(spec) + TERMINATION_MARGIN_S


def torchrun_args(
    job_id: str,
    spec: JobSpec,
    *,
    rdzv_endpoint: str,
    spec_path: str,
    rdzv: RendezvousConfig,
    module: str = "worker",
    peer: bool = False,
) -> list[str]:
    """The arguments after ``python``: torchrun (as a module) running ``-m <module>``; with
    ``peer``, a private one-node rendezvous (see the module docstring)."""
    if peer:
        return [
            "-m", "torch.distributed.run",
            "--standalone",
            "--nnodes=1:1",
            f"--nproc-per-node={spec.nproc_per_node}",
            f"--max-restarts={spec.max_restarts}",
            f"--shutdown-timeout={shutdown_timeout(spec)}",
            "--monitor-interval=0.1",
            "--module", module,
            "--config", spec_path,
        ]  # fmt: skip
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
        f"--shutdown-timeout={shutdown_timeout(spec)}",
        "--monitor-interval=0.1",
        "--module", module,
        "--config", spec_path,
    ]  # fmt: skip


def node_env(node: NodeLaunch) -> dict[str, str]:
    """The environment of a node's torchrun agent (and so of its workers): the spec's ``env``
    (the team's, e.g. ``PYTHONPATH``), what the service says (``node.env``), then what no caller
    overrides: the rendezvous variable and who the node is. (The spec cannot name the service's
    variables: :func:`worker.jobspec.limits.check_env_name`.) In peer mode: the recovery and the
    node's role."""
    peer = {RECOVERY_ENV: "peer", ROLE_ENV: node.role} if node.recovery == "peer" else {}
    return {
        **node.spec.env,
        **dict(node.env),
        **LAUNCH_ENV,
        "ELASTRAIN_JOB_ID": node.job_id,
        "ELASTRAIN_NODE_INDEX": str(node.node_index),
        "ELASTRAIN_LAUNCH_ID": node.launch_id,
        **peer,
    }


def node_app(
    node: NodeLaunch,
    *,
    rdzv_endpoint: str,
    image: str,
    checkpoint_mount: str | None = None,
    checkpoint_claim: str | None = None,
    spec_path: str | None = None,
    python: str = "python",
    rdzv: RendezvousConfig | None = None,
    app_name: str | None = None,
    module: str = "worker",
) -> specs.AppDef:
    """The TorchX app of one node: one replica running one torchrun agent, with :func:`node_env`.
    Its rendezvous goes through the job's key-value gateway when the service gives one
    (``ELASTRAIN_KV_GATEWAY`` in ``node.env``), else to ``rdzv_endpoint``.

    ``spec_path``: where the agent reads the spec; ``None`` ships the spec in the environment
    (``ELASTRAIN_SPEC_JSON``) and the command writes it to ``/tmp/elastrain/spec.json`` first
    (for containers, which share no files with the service). ``checkpoint_claim`` mounts that
    PersistentVolumeClaim at ``checkpoint_mount``. Pure.
    """
    if node.node_index < 0:
        raise SpecError(f"node index {node.node_index} must be 0 or more")
    if checkpoint_claim and not checkpoint_mount:
        raise SpecError("a checkpoint claim needs a mount path")
    config = rdzv or RendezvousConfig()
    path = spec_path or K8S_SPEC_PATH
    args = torchrun_args(
        node.job_id, node.spec, rdzv_endpoint=node.env.get(GATEWAY_ENV) or rdzv_endpoint, spec_path=path,
        rdzv=config, module=module, peer=node.recovery == "peer",
    )  # fmt: skip
    role_env = node_env(node)
    if spec_path is None:
        role_env[SPEC_ENV] = spec_json(node.spec)
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
        resource=resource_from_spec(node.spec.resources),
        mounts=mounts,
    )
    name = app_name or k8s_name(f"{node.job_id}-n{node.node_index}")
    return specs.AppDef(name=name, roles=[role])


def local_node_app(
    node: NodeLaunch,
    settings: SchedulerSettings,
    *,
    node_dir: str,
    spec_path: str,
    python: str,
    workdir: str,
    import_root: str,
) -> specs.AppDef:
    """The app of one node on this machine: :func:`node_app` run by ``python``, under the node
    wrapper (:mod:`service.launch.node_exec`, which records the node's fate in ``node_dir``),
    in ``workdir``, with ``import_root`` (the directory holding ``service`` and ``worker``) on
    the ``PYTHONPATH`` after the spec's and the caller's, and the host's GPUs hidden from a job
    of several node apps (:mod:`service.launch.gpus`); the node's environment is what it is given
    and the machine's allowed variables (:mod:`service.launch.environment`), never the service's. Pure."""
    given = (node.spec.env.get("PYTHONPATH", ""), node.env.get("PYTHONPATH", ""), import_root)
    pythonpath = os.pathsep.join(p for p in given if p)
    share = threads.local(cores=settings.host_cores, slots=settings.local_slots).env(node.spec)
    env = {**share, **node.env, **gpus.hide(node.spec, settings.host_gpus), "PYTHONPATH": pythonpath}
    app = node_app(
        dataclasses.replace(node, env=env),
        rdzv_endpoint=settings.rdzv_endpoint,
        image=workdir,
        spec_path=spec_path,
        python=python,
        rdzv=settings.rdzv,
        app_name=k8s_name(node.launch_id),
        module=settings.worker_module,
    )
    role = app.roles[0]
    names = ",".join(sorted(role.env))  # the node's environment: these, and the machine's allowed ones
    role.args = [
        "-m", "service.launch.node_exec", "--state-dir", node_dir, "--env", names, "--",
        role.entrypoint, *role.args,
    ]  # fmt: skip
    role.entrypoint = python
    return app


def k8s_name(text: str, limit: int = 50) -> str:
    """A DNS-label-safe name (lowercase alphanumerics and '-'), short enough for TorchX's suffix."""
    name = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].strip("-")
    return name or "node"
