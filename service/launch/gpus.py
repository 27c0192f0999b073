"""GPUs on one machine: the local scheduler runs every node of a job on the service's own host.

NCCL gives each rank a GPU of its own and refuses two ranks on one. A node's workers take GPUs
``0 .. nproc_per_node - 1`` of what they see (``worker.start.dist.detect``), so two nodes of one job on
one host would take the same GPUs and fail at their first collective. The local scheduler
therefore hides the host's GPUs (``CUDA_VISIBLE_DEVICES=""``) from the nodes of a job that can
have more than one node app at a time (``nodes`` above 1, or warm spares in peer mode): they train
on CPU with gloo, and the job's submitted event says so. A job of one node keeps the host's GPUs
(NCCL when each of its processes has one). A spec that sets ``CUDA_VISIBLE_DEVICES`` in ``env``
decides for itself. ``ddp.backend: nccl`` for a job whose GPUs would be hidden is refused at
submit. Several nodes of one job on a GPU each, on one host, would need the service to hand out
GPU sets and follow them through spare promotions: not done (a cluster gives each pod its own).

Pure: what the host holds is read by :mod:`service.launch.hostgpus`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from service.jobs import peer
from worker.errors import SpecError
from worker.jobspec.spec import JobSpec, parse_nodes

VISIBLE = "CUDA_VISIBLE_DEVICES"


def node_places(spec: JobSpec) -> int:
    """How many node apps of the job can run at once: its most nodes, and its spares in peer mode."""
    return parse_nodes(spec.nodes)[1] + (peer.spares(spec) if peer.peer_mode(spec) else 0)


def hidden_reason(spec: JobSpec, gpus: int) -> str | None:
    """Why the local scheduler hides this host's ``gpus`` from the job's nodes, or None when it
    does not (no GPU, one node app at a time, or ``CUDA_VISIBLE_DEVICES`` in the spec's env)."""
    places = node_places(spec)
    if gpus == 0 or places == 1 or VISIBLE in spec.env:
        return None
    return (
        f"on CPU (gloo): the local scheduler runs this job's {places} node apps on one machine, "
        f'and NCCL cannot share its {gpus} GPU(s) among nodes; for the GPUs, submit nodes "1" '
        f"with nproc_per_node up to {gpus}"
    )


def check(spec: JobSpec, gpus: int) -> str | None:
    """Refuse ``ddp.backend: nccl`` for a job whose nodes would not see the GPUs; otherwise
    :func:`hidden_reason` (what the submitted event says). Pure."""
    reason = hidden_reason(spec, gpus)
    if reason is not None and spec.ddp.backend == "nccl":
        raise SpecError(
            f"field 'ddp.backend': nccl cannot run here: the job would train {reason}; or use "
            "ddp.backend auto"
        )
    return reason


def hide(spec: JobSpec, gpus: int) -> Mapping[str, str]:
    """What a node of the job adds to its environment on this host (:func:`hidden_reason`)."""
    return {VISIBLE: ""} if hidden_reason(spec, gpus) is not None else {}


def visible(env: Mapping[str, str]) -> int | None:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` in ``env`` lets a process see (empty or ``-1`` first:
    none; CUDA stops at the first invalid entry), or None when it is not set. Pure."""
    if VISIBLE not in env:
        return None
    seen = 0
    for entry in (e.strip() for e in env[VISIBLE].split(",")):
        if not entry or entry.startswith("-"):
            break
        seen += 1
    return seen


def nvidia_devices(names: Iterable[str]) -> int:
    """How many of the device file ``names`` (of ``/dev``) are GPUs: ``nvidiaN``. Pure."""
    return sum(1 for name in names if name.startswith("nvidia") and name[6:].isdigit())
