"""The etcd key layout of the control plane (one place, so nothing else spells a key)."""

from __future__ import annotations

import hashlib
import re

from service.etcd.access import rendezvous_prefix

ROOT = "/elastrain"
JOBS = f"{ROOT}/jobs/"
IDEMPOTENCY = f"{ROOT}/idempotency/"
WORKER_SECRET = f"{ROOT}/config/worker-secret"
JOB_ID_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def job(job_id: str) -> str:
    return f"{JOBS}{job_id}"


def idempotency(key: str) -> str:
    return IDEMPOTENCY + hashlib.sha256(key.encode()).hexdigest()


DIR_CLAIMS = f"{ROOT}/dirs"


def dir_claim(path: str) -> str:
    """Which job a checkpoint directory (its real, absolute path) belongs to; the key of a
    directory's descendants start with this key and '/'."""
    return f"{DIR_CLAIMS}{path}"


def quarantine(job_id: str) -> str:
    """Where the bytes of a job record the service could not read are kept, as found."""
    return f"{ROOT}/quarantine/{job_id}"


PROGRESS = f"{ROOT}/progress/"
HEARTBEATS = f"{ROOT}/heartbeats/"


def progress(job_id: str) -> str:
    return f"{PROGRESS}{job_id}"


def heartbeats(job_id: str) -> str:
    return f"{HEARTBEATS}{job_id}/"


def heartbeat(job_id: str, launch_id: str, local_rank: int) -> str:
    return f"{heartbeats(job_id)}{launch_id}/{local_rank:05d}"


def reports(job_id: str) -> str:
    return f"{ROOT}/reports/{job_id}/"


def report_round(job_id: str, step: int, generation: int, seq: int = 0) -> str:
    return f"{reports(job_id)}{step:012d}-{generation:06d}-{seq:06d}/"


def report(job_id: str, step: int, generation: int, rank: int, seq: int = 0) -> str:
    return f"{report_round(job_id, step, generation, seq)}{rank:06d}"


def outcomes(job_id: str) -> str:
    return f"{ROOT}/outcomes/{job_id}/"


def outcome(job_id: str, step: int, generation: int, seq: int = 0) -> str:
    return f"{outcomes(job_id)}{step:012d}-{generation:06d}-{seq:06d}"


def checkpoints(job_id: str) -> str:
    return f"{ROOT}/checkpoints/{job_id}/"


def checkpoint(job_id: str, step: int) -> str:
    return f"{checkpoints(job_id)}{step:012d}"


def group_desired(job_id: str) -> str:
    """What the service wants of a peer-mode job's group: ``{"nodes", "spares",
    "epoch"}``, read by its workers. Under the job's rendezvous prefix: within the job's etcd
    role, and deleted with the rest of the rendezvous when the job ends."""
    return f"{rendezvous_prefix(job_id)}group/desired"


def job_prefixes(job_id: str) -> tuple[str, ...]:
    """Per-job prefixes (each ends in '/') of transient data, dropped when a job finishes: its
    heartbeats, checkpoint reports and outcomes, and its torchrun rendezvous."""
    return (heartbeats(job_id), reports(job_id), outcomes(job_id), rendezvous_prefix(job_id))
