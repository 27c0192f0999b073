"""Worker tokens: ``ewk.<job id>.<hmac>``, derived from a service secret kept in etcd.

Deriving (instead of storing the token) lets a restarted service give the same token to a node
it launches again; the job record keeps only the token's hash.
"""

from __future__ import annotations

import hashlib
import hmac

WORKER_PREFIX = "ewk"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def derive_worker_token(secret: bytes, job_id: str) -> str:
    mac = hmac.new(secret, job_id.encode(), hashlib.sha256).hexdigest()
    return f"{WORKER_PREFIX}.{job_id}.{mac}"


def worker_token_job(secret: bytes, token: str) -> str | None:
    """The job a genuine worker token belongs to, or None for anything else."""
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != WORKER_PREFIX:
        return None
    expected = derive_worker_token(secret, parts[1])
    return parts[1] if hmac.compare_digest(expected, token) else None
