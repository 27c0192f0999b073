"""The key-value gateway's budgets and lease ownership: what one job may keep in etcd, what all
jobs may keep and write, and which leases are whose (pure; the caller passes the time).

A write is admitted only if the job's stored bytes and keys stay within :class:`KvBudget` (and
all jobs' bytes within the global cap, all jobs' writes within the global rate); one request's
written bytes are capped too. A fill is refused with the budget's name, never an etcd quota
alarm. A job may keep alive, revoke or attach only leases granted to it (:class:`LeaseLedger`).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from service.etcd.gateway_rules import Checked, GatewayRefused


@dataclass(frozen=True, kw_only=True, slots=True)
class KvBudget:
    """What one job may keep in etcd through the gateway, and all jobs together."""

    job_bytes: int
    """Bytes stored under one job's prefix (keys plus values)."""
    job_keys: int
    """Keys under one job's prefix."""
    request_bytes: int
    """Bytes one request may write (every put of a txn, both branches)."""
    job_leases: int
    """Leases one job may hold at once."""
    lease_ttl_s: int
    """The longest TTL a lease may be granted."""
    total_bytes: int
    """Bytes stored through the gateway by all jobs together."""
    write_bytes_per_s: int
    """Bytes all jobs together may write per second (a burst of :data:`BURST_S` seconds of it)."""

    @classmethod
    def from_settings(cls, settings: Any) -> KvBudget:
        """From the service's ``kv_*`` settings."""
        return cls(
            job_bytes=settings.kv_job_bytes,
            job_keys=settings.kv_job_keys,
            request_bytes=settings.kv_request_bytes,
            job_leases=settings.kv_job_leases,
            lease_ttl_s=settings.kv_lease_ttl_s,
            total_bytes=settings.kv_total_bytes,
            write_bytes_per_s=settings.kv_write_bytes_per_s,
        )


BURST_S = 30.0


@dataclass(slots=True)
class WriteRate:
    """A token bucket of bytes written through the gateway by all jobs (pure: the caller passes
    the time)."""

    rate: float
    tokens: float
    at: float

    def take(self, size: int, *, now: float) -> None:
        """Take ``size`` bytes, or raise :class:`GatewayRefused` (429) saying when to retry."""
        burst = self.rate * BURST_S
        self.tokens = min(burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if size > self.tokens:
            wait = (size - self.tokens) / self.rate
            raise GatewayRefused(
                429,
                "over_budget",
                f"the jobs write faster than {int(self.rate)} bytes/s through the gateway; "
                f"retry in {wait:.1f} s (kv budget write_bytes_per_s)",
            )
        self.tokens -= size


@dataclass(frozen=True, slots=True)
class Usage:
    """What a job stores under its prefix: bytes (keys plus values) and keys."""

    bytes: int = 0
    keys: int = 0


def admit_write(checked: Checked, *, usage: Usage, others_bytes: int, budget: KvBudget) -> None:
    """Raise :class:`GatewayRefused` (413) when the write could take the job past its
    budget: every put counted as a new key of its full size (an overwrite frees the old bytes,
    so this errs on the side of refusing only when ``usage`` is already near the cap). Pure."""
    size = checked.written_bytes
    if size > budget.request_bytes:
        raise GatewayRefused(
            413,
            "too_large",
            f"this request writes {size} bytes; one request may write at most "
            f"{budget.request_bytes} (kv budget request_bytes)",
        )
    if usage.bytes + size > budget.job_bytes:
        raise GatewayRefused(
            413,
            "over_budget",
            f"the job stores {usage.bytes} bytes in its keys; writing {size} more would pass "
            f"its budget of {budget.job_bytes} bytes (kv budget job_bytes)",
        )
    if usage.keys + len(checked.puts) > budget.job_keys:
        raise GatewayRefused(
            413,
            "over_budget",
            f"the job stores {usage.keys} keys; its budget is {budget.job_keys} keys (kv budget job_keys)",
        )
    if others_bytes + usage.bytes + size > budget.total_bytes:
        raise GatewayRefused(
            413,
            "over_budget",
            f"the jobs together store {others_bytes + usage.bytes} bytes through the gateway; "
            f"its cap is {budget.total_bytes} (kv budget total_bytes)",
        )


def usage_of(kvs: Iterable[Mapping[str, Any]]) -> Usage:
    """A job's usage from etcd's range answer of its prefix (``kvs``, base64 keys and values)."""
    sizes = [
        len(base64.b64decode(kv.get("key", ""))) + len(base64.b64decode(kv.get("value", ""))) for kv in kvs
    ]
    return Usage(sum(sizes), len(sizes))


class LeaseLedger:
    """Which job each lease granted through the gateway belongs to, and until when it lives
    (refreshed by keep-alives); in memory, pure (the caller passes the time). A lease not here
    (the service restarted) is looked up by the caller in its own record and :meth:`adopt`-ed."""

    def __init__(self) -> None:
        self._owner: dict[int, tuple[str, float]] = {}

    def grant(self, job_id: str, lease: int, *, expires_at: float) -> None:
        self._owner[lease] = (job_id, expires_at)

    adopt = grant

    def owner(self, lease: int) -> str | None:
        found = self._owner.get(lease)
        return None if found is None else found[0]

    def refresh(self, lease: int, *, expires_at: float) -> None:
        found = self._owner.get(lease)
        if found is not None:
            self._owner[lease] = (found[0], expires_at)

    def forget(self, lease: int) -> None:
        self._owner.pop(lease, None)

    def live(self, job_id: str, *, now: float) -> int:
        """How many leases ``job_id`` holds that have not expired (expired ones are dropped)."""
        for lease in [k for k, (_, until) in self._owner.items() if until <= now]:
            del self._owner[lease]
        return sum(1 for owner, _ in self._owner.values() if owner == job_id)

    def unknown(self, leases: Iterable[int]) -> Iterator[int]:
        return (lease for lease in leases if lease not in self._owner)


def check_leases(job_id: str, leases: Iterable[int], ledger: LeaseLedger) -> None:
    """Every lease a request names was granted to ``job_id``; raises :class:`GatewayRefused`
    (403, in etcd's words for a lease it does not have) otherwise. Pure."""
    for lease in leases:
        owner = ledger.owner(lease)
        if owner != job_id:
            # "requested lease not found" is etcd's own words: a client takes a new lease, as it
            # does when its lease expired (one that expired while the service was down is unknown)
            message = (
                f"requested lease not found: lease {lease} was not granted to job {job_id!r} "
                "through the gateway"
            )
            raise GatewayRefused(403, "forbidden", message)


def check_grant(job_id: str, ttl: int, ledger: LeaseLedger, budget: KvBudget, *, now: float) -> None:
    """A new lease for ``job_id``: a positive TTL within the cap, and room under its lease count."""
    if not 0 < ttl <= budget.lease_ttl_s:
        raise GatewayRefused(
            422,
            "invalid",
            f"lease/grant: TTL {ttl} s; give 1 to {budget.lease_ttl_s} s (kv budget lease_ttl_s)",
        )
    if ledger.live(job_id, now=now) >= budget.job_leases:
        raise GatewayRefused(
            413,
            "over_budget",
            f"the job holds {budget.job_leases} leases; revoke one first (kv budget job_leases)",
        )
