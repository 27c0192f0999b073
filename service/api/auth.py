"""Who may call what, decided from plain values.

Two kinds of bearer token: the API token (everything under /v1) and a per-job worker token
(see :mod:`service.jobs.tokens`) that reaches only its own job's worker callbacks and ``/resume``.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Literal

from service.jobs.tokens import hash_token, worker_token_job

Principal = Literal["api", "worker"]


@dataclass(frozen=True, slots=True)
class AuthDecision:
    principal: Principal | None
    status: int = 200
    code: str = ""
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.principal is not None


def job_of(path: str) -> str | None:
    """The job a ``/v1/jobs/{id}...`` path names (None for ``/v1/jobs`` itself)."""
    parts = path.split("/")
    return parts[3] if len(parts) > 3 and parts[:3] == ["", "v1", "jobs"] and parts[3] else None


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def authorize(
    token: str | None,
    *,
    api_token_hash: str,
    secret: bytes,
    job_id: str | None,
    worker_route: bool,
) -> AuthDecision:
    """The API token passes everywhere; a worker token only on ``worker_route`` of its job."""
    if token is None:
        return AuthDecision(
            None,
            401,
            "unauthenticated",
            "missing bearer token: send 'Authorization: Bearer <token>' with the API token "
            "(ELASTRAIN_API_TOKEN, or the api-token file the service printed at start)",
        )
    if hmac.compare_digest(hash_token(token), api_token_hash):
        return AuthDecision("api")
    owner = worker_token_job(secret, token)
    if owner is None:
        return AuthDecision(
            None,
            401,
            "unauthenticated",
            "the bearer token is not valid for this service: use the service's API token "
            "(ELASTRAIN_API_TOKEN, or the api-token file the service printed at start)",
        )
    if not worker_route:
        return AuthDecision(
            None,
            403,
            "forbidden",
            "a worker token reaches only its job's worker callbacks; use the API token",
        )
    if owner != job_id:
        return AuthDecision(
            None, 403, "forbidden", f"this worker token belongs to job {owner!r}, not {job_id!r}"
        )
    return AuthDecision("worker")


def at_the_door(
    path: str,
    header: str | None,
    *,
    public: frozenset[str],
    api_token_hash: str,
    secret: bytes,
) -> AuthDecision | None:
    """Whether a request may come in, from its path and ``Authorization`` header alone (before
    its body is read). None: a public path (probes, metrics, the schema). The API token passes;
    a worker token passes only under its own job's ``/v1/jobs/<id>`` (the route's dependency
    then decides which of that job's routes it reaches); anything else is refused here."""
    if path in public:
        return None
    job = job_of(path)
    return authorize(
        bearer(header),
        api_token_hash=api_token_hash,
        secret=secret,
        job_id=job,
        worker_route=job is not None,
    )
