"""The group's keys in etcd, behind a small :class:`KeyValue` interface.

All keys live under ``/elastrain/rdzv/<job id>/group/`` (a job's etcd role is limited to its
rendezvous prefix ``/elastrain/rdzv/<job id>/``):

==================== ============================================ ============== ===========
key                  value                                        writer         lifetime
==================== ============================================ ============== ===========
``members/<id>``     :class:`~worker.recovery.records.MemberInfo` each worker    its lease
``gen``              :class:`~worker.recovery.records.GenRecord`  the leader,    durable
                                                                  compare-and-set
``desired``          :class:`~worker.recovery.records.Desired`    the service    durable
``incidents/<id>``   the recovery record (JSON object)            the leader     durable
==================== ============================================ ============== ===========

The generation only grows; writing ``gen`` is a compare-and-set on its ``mod_revision``, so of
two leaders that decided concurrently exactly one wins, and the loser reads the winner's record.
:class:`MemoryKeyValue` has etcd's semantics in one process (tests); the etcd adapter over the
project's one etcd client comes with the integration.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from worker.errors import ElastrainError
from worker.recovery.records import Desired, GenRecord, MemberInfo, RecordError, dump, parse

ROOT = "/elastrain/rdzv/"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class KeyValueUnavailable(ElastrainError):
    """The key-value store (etcd) did not answer; the caller retries or falls back."""


class Stamped(NamedTuple):
    value: bytes
    revision: int  # etcd's mod_revision


class KeyValue(Protocol):
    """What the group needs from etcd. Every method raises :class:`KeyValueUnavailable` when
    the store cannot answer."""

    def get(self, key: str) -> Stamped | None: ...

    def compare_and_set(self, key: str, value: bytes, *, revision: int, lease: int = 0) -> bool:
        """Write if the key's mod_revision is ``revision`` (0: the key must not exist)."""
        ...

    def put(self, key: str, value: bytes, *, lease: int = 0) -> None: ...

    def list_prefix(self, prefix: str) -> list[tuple[str, Stamped]]: ...

    def delete(self, key: str) -> None:
        """Idempotent."""
        ...

    def lease_grant(self, ttl_s: int) -> int: ...

    def lease_keepalive(self, lease: int) -> bool:
        """Refresh a lease; False once it has expired."""
        ...

    def lease_revoke(self, lease: int) -> None:
        """Idempotent."""
        ...


class Keys:
    """The key layout of one job's group."""

    def __init__(self, job_id: str) -> None:
        if not _JOB_ID.match(job_id):
            raise ValueError(
                f"job id {job_id!r} cannot name etcd keys: use letters, digits, '.', '_' or '-' (at most 128)"
            )
        self.prefix = f"{ROOT}{job_id}/group/"
        self.members = self.prefix + "members/"
        self.gen = self.prefix + "gen"
        self.desired = self.prefix + "desired"
        self.incidents = self.prefix + "incidents/"
        self.finished = self.prefix + "finished"  # written once training finished (worker.peer.loop)

    def member(self, member_id: str) -> str:
        return self.members + member_id

    def incident(self, incident_id: str) -> str:
        return self.incidents + incident_id.replace("/", "_")


class Membership:
    """This process's entry in the group's keys, kept alive by a lease, and the shared records.

    ``register`` starts a daemon thread that refreshes the lease every ``keepalive_s`` and
    writes :meth:`update`'s newest value off the training thread; an expired lease (etcd was
    away longer than ``ttl_s``) is replaced and the entry written again."""

    def __init__(self, kv: KeyValue, job_id: str, *, ttl_s: int = 10, keepalive_s: float = 3.0) -> None:
        self.kv, self.keys = kv, Keys(job_id)
        self.ttl_s, self.keepalive_s = ttl_s, keepalive_s
        self.lease = 0
        self.last_error = ""
        self._info: MemberInfo | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, info: MemberInfo) -> None:
        self._info = info
        self.lease = self.kv.lease_grant(self.ttl_s)
        self.kv.put(self.keys.member(info.member_id), dump(info), lease=self.lease)
        self._thread = threading.Thread(target=self._keepalive, name="elastrain-member-lease", daemon=True)
        self._thread.start()

    def update(self, info: MemberInfo) -> None:
        """Publish a new value of this member's entry (written by the lease thread)."""
        self._info = info
        self._dirty.set()

    def _keepalive(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait(self.keepalive_s)
            if self._stop.is_set():
                return
            try:
                self._refresh()
            except KeyValueUnavailable as exc:
                self.last_error = str(exc)[:300]

    def _refresh(self) -> None:
        info = self._info
        assert info is not None
        write = self._dirty.is_set()
        self._dirty.clear()
        if not self.kv.lease_keepalive(self.lease):
            self.lease = self.kv.lease_grant(self.ttl_s)
            write = True
        if write:
            self.kv.put(self.keys.member(info.member_id), dump(info), lease=self.lease)
        self.last_error = ""

    def members(self) -> dict[str, MemberInfo]:
        """Every registered member (entries that do not parse are skipped)."""
        out: dict[str, MemberInfo] = {}
        for key, stamped in self.kv.list_prefix(self.keys.members):
            try:
                info = MemberInfo.from_json(parse(stamped.value, what=key))
            except RecordError:
                continue
            out[info.member_id] = info
        return out

    def generation(self) -> tuple[GenRecord | None, int]:
        """The current generation record and its revision (``None, 0`` before the first)."""
        stamped = self.kv.get(self.keys.gen)
        if stamped is None:
            return None, 0
        return GenRecord.from_json(parse(stamped.value, what=self.keys.gen)), stamped.revision

    def commit_generation(self, record: GenRecord, *, revision: int) -> bool:
        """Compare-and-set ``gen`` from ``revision`` (0: create); False when another leader won."""
        return self.kv.compare_and_set(self.keys.gen, dump(record.to_json()), revision=revision)

    def desired(self) -> Desired | None:
        stamped = self.kv.get(self.keys.desired)
        if stamped is None:
            return None
        return Desired.from_json(parse(stamped.value, what=self.keys.desired))

    def put_incident(self, incident_id: str, record: dict[str, Any]) -> None:
        self.kv.put(self.keys.incident(incident_id), dump(record))

    def close(self) -> None:
        """Stop the lease thread and revoke the lease (the entry disappears). Idempotent."""
        self._stop.set()
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.lease:
            try:
                self.kv.lease_revoke(self.lease)
            except KeyValueUnavailable as exc:  # the lease expires on its own
                self.last_error = f"revoking lease {self.lease}: {exc}"[:300]
            self.lease = 0


class MemoryKeyValue:
    """:class:`KeyValue` in one process with etcd's semantics: revisions, compare-and-set,
    leases that an injectable clock expires. ``available = False`` makes every call fail."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._data: dict[str, tuple[bytes, int, int]] = {}  # value, mod_revision, lease
        self._leases: dict[int, tuple[float, int]] = {}  # expiry, ttl
        self._revision = 1
        self._ids = itertools.count(7001)
        self.available = True

    def _check(self) -> None:
        if not self.available:
            raise KeyValueUnavailable("the in-memory store is marked unavailable")
        now = self._clock()
        for lease, (expires, _) in list(self._leases.items()):
            if expires <= now:
                self._drop(lease)

    def _drop(self, lease: int) -> None:
        self._leases.pop(lease, None)
        for key in [k for k, (_, _, owner) in self._data.items() if owner == lease]:
            del self._data[key]

    def _write(self, key: str, value: bytes, lease: int) -> None:
        if lease and lease not in self._leases:
            raise KeyValueUnavailable(f"lease {lease} not found")
        self._revision += 1
        self._data[key] = (value, self._revision, lease)

    def get(self, key: str) -> Stamped | None:
        with self._lock:
            self._check()
            item = self._data.get(key)
            return Stamped(item[0], item[1]) if item else None

    def compare_and_set(self, key: str, value: bytes, *, revision: int, lease: int = 0) -> bool:
        with self._lock:
            self._check()
            item = self._data.get(key)
            if (item[1] if item else 0) != revision:
                return False
            self._write(key, value, lease)
            return True

    def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        with self._lock:
            self._check()
            self._write(key, value, lease)

    def list_prefix(self, prefix: str) -> list[tuple[str, Stamped]]:
        with self._lock:
            self._check()
            return [(k, Stamped(v[0], v[1])) for k, v in sorted(self._data.items()) if k.startswith(prefix)]

    def delete(self, key: str) -> None:
        with self._lock:
            self._check()
            if self._data.pop(key, None) is not None:
                self._revision += 1

    def lease_grant(self, ttl_s: int) -> int:
        with self._lock:
            self._check()
            lease = next(self._ids)
            self._leases[lease] = (self._clock() + ttl_s, ttl_s)
            return lease

    def lease_keepalive(self, lease: int) -> bool:
        with self._lock:
            self._check()
            if lease not in self._leases:
                return False
            ttl = self._leases[lease][1]
            self._leases[lease] = (self._clock() + ttl, ttl)
            return True

    def lease_revoke(self, lease: int) -> None:
        with self._lock:
            self._check()
            self._drop(lease)
