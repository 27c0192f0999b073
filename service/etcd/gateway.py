"""The jobs' key-value gateway: a job's etcd requests, checked, sent with the service's own client.

A job's rendezvous (torchrun's etcd-v3 backend) and its peer group keep their keys under the
job's prefix, ``/elastrain/rdzv/<job id>/``. Jobs are given neither an etcd endpoint nor an etcd
credential; they post the bodies of etcd's v3 JSON gateway to ``POST /v1/jobs/{id}/kv/{op}``
with their worker token, and :class:`KvGateway` forwards what :mod:`service.etcd.gateway_rules`
admits (the threat model is written there). etcd's answer comes back as it is.

State kept here, per service instance (the leader takes every write; a standby forwards it):

* **Lease owners**: a grant is recorded in a :class:`~service.etcd.gateway_rules.LeaseLedger`
  and in etcd under ``/elastrain/gateway/leases/<lease id>`` (the job's id, attached to the
  lease itself so it vanishes with it), outside every job's prefix. A lease the ledger does not
  know (the service restarted) is looked up there.
* **Usage**: each job's stored bytes and keys, read from etcd (a range of its prefix) when the
  estimate is older than ``refresh_s`` or a write would pass the budget, and raised by every
  admitted write in between. Writes of one job are serialised here, so the check and the write
  cannot interleave with another of the same job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from service.etcd.access import rendezvous_prefix
from service.etcd.gateway_budget import (
    BURST_S,
    KvBudget,
    LeaseLedger,
    Usage,
    WriteRate,
    admit_write,
    check_grant,
    check_leases,
    usage_of,
)
from service.etcd.gateway_rules import Checked, GatewayRefused, check_request
from worker.etcdclient import EtcdClient, b64, put_request, range_end, unb64

LEASE_RECORDS = "/elastrain/gateway/leases/"
"""Where the gateway records which job each lease it granted belongs to (no job reaches it)."""


@dataclass(slots=True)
class _Job:
    lock: threading.Lock = field(default_factory=threading.Lock)
    usage: Usage = field(default_factory=Usage)
    read_at: float = float("-inf")


class KvGateway:
    """Checks and forwards jobs' etcd requests (see the module docstring)."""

    def __init__(
        self,
        client: EtcdClient,
        budget: KvBudget,
        *,
        refresh_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.budget = budget
        self.refresh_s = refresh_s
        self.clock = clock
        self.ledger = LeaseLedger()
        self._rate = WriteRate(budget.write_bytes_per_s, budget.write_bytes_per_s * BURST_S, clock())
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()

    def handle(self, job_id: str, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """etcd's answer to ``op`` with ``body`` for ``job_id``; raises
        :class:`~service.etcd.gateway_rules.GatewayRefused` for what the job may not do, and the
        client's errors when etcd refuses or cannot be reached."""
        checked = check_request(op, body, rendezvous_prefix(job_id))
        self._own(job_id, checked.leases)
        if op == "lease/grant":
            return self._grant(job_id, int(body.get("TTL", 0)))
        if op == "kv/range":
            return self.client.post(op, body)
        if op == "lease/keepalive":
            answer = self.client.post(op, body)
            ttl = int(answer.get("result", {}).get("TTL", 0) or 0)
            self.ledger.refresh(checked.leases[0], expires_at=self.clock() + ttl)
            return answer
        job = self._job(job_id)
        with job.lock:
            if checked.puts:
                self._admit(job_id, job, checked)
            answer = self.client.post(op, body, replay_safe=op != "kv/txn" or not checked.puts)
            if checked.puts:
                job.usage = Usage(job.usage.bytes + checked.written_bytes, job.usage.keys + len(checked.puts))
            elif op == "kv/deleterange":
                job.read_at = float("-inf")  # read again before the next write
        if op == "kv/lease/revoke":
            self.ledger.forget(checked.leases[0])
        return answer

    def usage(self, job_id: str) -> Usage:
        """The job's usage as last read or estimated."""
        return self._job(job_id).usage

    def forget(self, job_id: str) -> None:
        """Drop what is kept of an ended job (its keys are deleted by the service)."""
        with self._lock:
            self._jobs.pop(job_id, None)

    def _job(self, job_id: str) -> _Job:
        with self._lock:
            return self._jobs.setdefault(job_id, _Job())

    def _admit(self, job_id: str, job: _Job, checked: Checked) -> None:
        """Admit the write on the estimate while it is fresh; otherwise, or before refusing,
        on the usage read from etcd."""
        now = self.clock()
        if now - job.read_at <= self.refresh_s:
            try:
                admit_write(checked, usage=job.usage, others_bytes=self._others(job_id), budget=self.budget)
                with self._lock:
                    self._rate.take(checked.written_bytes, now=now)
                return
            except GatewayRefused as exc:
                if exc.status == 429:
                    raise
                # an estimate counts overwrites as new keys: read before refusing
        job.usage, job.read_at = self._read_usage(job_id), now
        admit_write(checked, usage=job.usage, others_bytes=self._others(job_id), budget=self.budget)
        with self._lock:
            self._rate.take(checked.written_bytes, now=now)

    def _others(self, job_id: str) -> int:
        with self._lock:
            return sum(j.usage.bytes for k, j in self._jobs.items() if k != job_id)

    def _read_usage(self, job_id: str) -> Usage:
        prefix = rendezvous_prefix(job_id)
        answer = self.client.post("kv/range", {"key": b64(prefix), "range_end": b64(range_end(prefix))})
        return usage_of(answer.get("kvs") or [])

    def _own(self, job_id: str, leases: tuple[int, ...]) -> None:
        for lease in self.ledger.unknown(leases):
            found = self.client.post("kv/range", {"key": b64(f"{LEASE_RECORDS}{lease}")}).get("kvs") or []
            if found and unb64(found[0].get("value", "")).decode() == job_id:
                self.ledger.adopt(job_id, lease, expires_at=self.clock() + self.budget.lease_ttl_s)
        check_leases(job_id, leases, self.ledger)

    def _grant(self, job_id: str, ttl: int) -> dict[str, Any]:
        with self._job(job_id).lock:
            check_grant(job_id, ttl, self.ledger, self.budget, now=self.clock())
            answer = self.client.post("lease/grant", {"TTL": ttl, "ID": 0})
            lease = int(answer["ID"])
            record = put_request(f"{LEASE_RECORDS}{lease}", job_id.encode(), lease=lease)
            self.client.post("kv/put", record)
            self.ledger.grant(job_id, lease, expires_at=self.clock() + int(answer.get("TTL", ttl)))
        return answer
