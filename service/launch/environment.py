"""What a local node's processes see of the machine's environment: an allowlist (pure).

The ``local_cwd`` scheduler starts nodes from the service's own process, whose environment holds
the service's secrets (``ELASTRAIN_API_TOKEN``, the etcd root password, storage credentials...).
A node's environment is therefore built, not inherited: the variables the service set for the
node (the job's ``env``, its worker token, its key-value gateway, who the node is), and of the
machine's only :data:`HOST_VARS` (what Python, torch and torchrun need to run: where programs
and libraries are, the user, locale, time zone, temporary directory, visible GPUs), the names
that start with :data:`HOST_PREFIXES` (locale, NCCL and gloo tuning, what TorchX sets for the
replica) and the worker's own switches :data:`WORKER_KNOBS` (fault injection and diagnostics,
none a secret). Everything else of the machine's is dropped.

On one machine this keeps the service's secrets out of a job's environment, not out of its
reach: the local scheduler runs jobs as the service's own OS user, so a job that reads the
service's files (its data directory) is not contained. Untrusted tenants belong on Kubernetes,
where a worker pod gets only its role's environment and a NetworkPolicy keeps it from etcd.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from service.jobs.objectstore import PLAIN_VARS, ObjectStorage

HOST_VARS = frozenset(
    {"PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
     "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_HOME",
     "PYTHONUNBUFFERED"}
)  # fmt: skip
HOST_PREFIXES = ("LC_", "NCCL_", "GLOO_", "TORCHX_", "TORCHELASTIC_", "PET_")
WORKER_KNOBS = frozenset(
    {"ELASTRAIN_FAILPOINTS", "ELASTRAIN_COLLECTIVE_TIMEOUT_S", "ELASTRAIN_TRACE_SAMPLES",
     "ELASTRAIN_METRICS_TARGETS_DIR", "ELASTRAIN_METRICS_ADDR", "ELASTRAIN_CHECKPOINT_COPY_ON_RESUME"}
)  # fmt: skip


def host_allowed(name: str) -> bool:
    """Whether a variable of the machine's may reach a node's processes."""
    return name in HOST_VARS or name in WORKER_KNOBS or name.startswith(HOST_PREFIXES)


def node_environment(inherited: Mapping[str, str], given: Iterable[str]) -> dict[str, str]:
    """A node's environment from what its launcher process ``inherited`` (the machine's and
    the service's variables, plus what the scheduler set): the ``given`` names (set for the
    node) and the allowed variables of the machine's. Pure."""
    keep = set(given)
    return {name: value for name, value in inherited.items() if name in keep or host_allowed(name)}


def launch_storage_env(storage: ObjectStorage | None, *, kubernetes: bool) -> dict[str, str]:
    """What the nodes of a job on ``s3://`` are told of the service's object storage: all its
    variables on one machine; on Kubernetes only where the store is (:data:`PLAIN_VARS`), the
    pods taking the credentials from a Secret (:func:`service.launch.dryrun.give_storage_secret`).
    Pure."""
    if storage is None:
        return {}
    return {k: v for k, v in storage.env.items() if not kubernetes or k in PLAIN_VARS}
