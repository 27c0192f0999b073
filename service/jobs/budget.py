"""How much a job's workers may send: a token bucket of requests and one of bytes per job, held
by this instance (the leader takes every write). In memory, with an injectable clock.

A worker token is held by job code, and what it sends lands in etcd, which every job shares:
30 checkpoint reports of 1 MB each grew etcd from 2.7 to 48.8 MB in 4.7 s. The budgets scale
with the job's world size W (the record's, else its desired nodes times processes per node) so
that a large job's heartbeats and reports fit: requests: a burst of ``256 + 8 W``, then
``16 + 2 W`` a second; bytes: a burst of ``16 MiB + 1 MiB x W``, then ``1 MiB + 256 KiB x W`` a
second. Over either, :meth:`WorkerBudget.charge` raises :class:`OverBudgetError` (429, with
when to retry) and nothing is written.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from service.jobs.errors import OverBudgetError

MIB = 1 << 20
IDLE_FORGET_S = 600.0


@dataclass(slots=True)
class _Bucket:
    requests: float
    bytes: float
    at: float


@dataclass(frozen=True, slots=True)
class Rates:
    """A job's budgets for world size ``w``."""

    request_burst: float
    requests_per_s: float
    byte_burst: float
    bytes_per_s: float

    @staticmethod
    def for_world_size(w: int) -> Rates:
        w = max(1, w)
        return Rates(256 + 8 * w, 16 + 2 * w, 16 * MIB + MIB * w, MIB + MIB // 4 * w)


class WorkerBudget:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def charge(self, job_id: str, *, world_size: int, size: int) -> None:
        """Take one request of ``size`` bytes from the job's budget, or raise OverBudgetError."""
        rates = Rates.for_world_size(world_size)
        now = self._clock()
        bucket = self._buckets.get(job_id) or _Bucket(rates.request_burst, rates.byte_burst, now)
        elapsed = max(0.0, now - bucket.at)
        bucket.requests = min(rates.request_burst, bucket.requests + elapsed * rates.requests_per_s)
        bucket.bytes = min(rates.byte_burst, bucket.bytes + elapsed * rates.bytes_per_s)
        bucket.at = now
        self._buckets[job_id] = bucket
        if bucket.requests < 1:
            wait = (1 - bucket.requests) / rates.requests_per_s
            raise OverBudgetError(
                f"job {job_id}'s workers sent more than {rates.requests_per_s:g} requests a second "
                f"(a burst of {rates.request_burst:g}); retry in {wait:.1f} s",
                retry_after=wait,
                budget="requests",
            )
        if bucket.bytes < size:
            wait = (size - bucket.bytes) / rates.bytes_per_s
            raise OverBudgetError(
                f"job {job_id}'s workers sent more than {rates.bytes_per_s / MIB:g} MiB a second (a "
                f"burst of {rates.byte_burst / MIB:g} MiB); retry in {wait:.1f} s",
                retry_after=wait,
                budget="bytes",
            )
        bucket.requests -= 1
        bucket.bytes -= size
        if len(self._buckets) > 1000:
            self._forget_idle(now)

    def forget(self, job_id: str) -> None:
        self._buckets.pop(job_id, None)

    def _forget_idle(self, now: float) -> None:
        self._buckets = {j: b for j, b in self._buckets.items() if now - b.at < IDLE_FORGET_S}
