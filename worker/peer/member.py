"""Peer mode's start: what the service's launch environment says (the peer contract,
/elastrain's ``ELASTRAIN_RECOVERY=peer``, ``ELASTRAIN_ROLE``, ``ELASTRAIN_NODE_ADDR``), turned into
this process's :class:`~worker.recovery.recover.GroupMember`; then a member joins the group and a
spare stands by, its trainer built, until promoted.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import socket
from collections.abc import Mapping
from urllib.parse import urlparse

from worker.errors import SpecError
from worker.jobspec.recovery import peer_requested as peer_requested  # the launch's mode (torch-free)
from worker.jobspec.spec import JobSpec, parse_nodes
from worker.recovery.plan import Policy
from worker.recovery.recover import EventSink, GroupMember
from worker.recovery.seam import RecoveryConfig
from worker.start.dist import DistInfo

ROLES = ("member", "spare")


def role(env: Mapping[str, str]) -> str:
    value = env.get("ELASTRAIN_ROLE", "member")
    if value not in ROLES:
        raise SpecError(f"ELASTRAIN_ROLE={value!r} must be one of {', '.join(ROLES)}")
    return value


def secret(token: str) -> bytes:
    """The control channel's shared secret, derived from the job's worker token."""
    if not token:
        raise SpecError("peer recovery needs ELASTRAIN_WORKER_TOKEN (the service sets it)")
    return hashlib.sha256(b"elastrain-peer-control:" + token.encode()).digest()


def advertise(env: Mapping[str, str]) -> str:
    """The address other workers reach this one at: ``ELASTRAIN_NODE_ADDR``; else 127.0.0.1 when
    the key-value gateway (or every etcd endpoint) is loopback; else the address of the interface
    that routes there."""
    given = env.get("ELASTRAIN_NODE_ADDR", "").strip()
    if given:
        return given
    given = env.get("ELASTRAIN_KV_GATEWAY") or env.get("ELASTRAIN_ETCD_ENDPOINTS", "")
    hosts = [urlparse(u.strip()).hostname or "" for u in given.split(",")]
    hosts = [h for h in hosts if h]
    if all(_loopback(h) for h in hosts):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent
        probe.connect((hosts[0], 2379))
        return str(probe.getsockname()[0])


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def config(
    spec: JobSpec, info: DistInfo, env: Mapping[str, str], *, spec_hash: str, timeout_s: float
) -> RecoveryConfig:
    """The group's configuration: sizes from ``nodes`` x ``nproc_per_node``, the job's id and
    secret, this node's address."""
    lo, hi = parse_nodes(spec.nodes)
    unit = spec.nproc_per_node
    job_id = env.get("ELASTRAIN_JOB_ID", "")
    if not job_id:
        raise SpecError("peer recovery needs ELASTRAIN_JOB_ID (the service sets it)")
    return RecoveryConfig(
        job_id=job_id, secret=secret(env.get("ELASTRAIN_WORKER_TOKEN", "")), spec_hash=spec_hash,
        policy=Policy(min_world=lo * unit, max_world=hi * unit, unit=unit),
        desired_world=(spec.initial_nodes or hi) * unit, advertise=advertise(env), backend=info.backend,
        device=info.device, collective_timeout_s=timeout_s,
    )  # fmt: skip


def member(
    cfg: RecoveryConfig, info: DistInfo, env: Mapping[str, str], *, on_event: EventSink, on_record: EventSink
) -> GroupMember:
    """This process in the group, registered and listening (etcd from the launch environment)."""
    from worker.recovery.etcdkv import from_env

    raw_index = env.get("ELASTRAIN_NODE_INDEX", "0")
    node_index = int(raw_index) if raw_index.isdigit() else 0
    group_member = GroupMember(
        cfg, kv=from_env(env), role=role(env), launch_id=env.get("ELASTRAIN_LAUNCH_ID", ""),
        node_index=node_index, local_rank=info.local_rank, on_event=on_event, on_record=on_record,
    )  # fmt: skip
    group_member.start()
    return group_member


def private_group(info: DistInfo, *, timeout_s: float) -> None:
    """A world of one on a private store: the trainer is built (and DDP wrapped once, which costs
    a new process 0.9-3 s: a spare pays it before it is needed) before the job's group exists.
    :func:`worker.recovery.group.teardown` ends it before the process joins."""
    import torch.distributed as dist

    dist.init_process_group(
        info.backend, store=dist.HashStore(), rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
