"""The control plane's state store in memory, with etcd's semantics (revisions, leases that an
injectable clock expires, fences): what the unit tests run on."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence

from service.etcd.kv import Entry, Fence, Versioned, Write
from worker.etcdclient import EtcdUnavailableError


class MemoryStore:
    """:class:`KVStore` in memory with etcd's semantics (revisions, leases, fences)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._data: dict[str, tuple[bytes, int, int]] = {}
        self._leases: dict[int, tuple[float, int]] = {}
        self._revision = 1
        self._ids = itertools.count(1000)
        self.available = True

    def _check(self) -> None:
        if not self.available:
            raise EtcdUnavailableError("memory store marked unavailable")
        now = self._clock()
        for lease_id, (expires, _) in list(self._leases.items()):
            if expires <= now:
                self._drop_lease(lease_id)

    def _drop_lease(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)
        doomed = [k for k, (_, _, lid) in self._data.items() if lid == lease_id]
        for key in doomed:
            del self._data[key]
        if doomed:
            self._revision += 1

    def get(self, key: str) -> Versioned | None:
        with self._lock:
            self._check()
            item = self._data.get(key)
            return Versioned(item[0], item[1]) if item else None

    def list_prefix(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 0,
        keys_only: bool = False,
        last: str | None = None,
    ) -> list[Entry]:
        with self._lock:
            self._check()
            keys = sorted(k for k in self._data if k.startswith(prefix))
            if start_after is not None:
                keys = [k for k in keys if k > start_after]
            if last is not None:
                keys = [k for k in keys if k.encode() <= last.encode()]
            keys = keys[:limit] if limit else keys
            return [Entry(k, b"" if keys_only else self._data[k][0], self._data[k][1]) for k in keys]

    def _holds(self, w: Write) -> bool:
        if w.expected is None:
            return True
        item = self._data.get(w.key)
        return (item[1] if item else 0) == w.expected

    def _fenced(self, fence: Fence | None) -> bool:
        if fence is None:
            return True
        item = self._data.get(fence.key)
        return item is not None and item[0] == fence.holder.encode() and item[2] == fence.lease_id

    def commit(self, writes: Sequence[Write], *, fence: Fence | None = None) -> bool:
        with self._lock:
            self._check()
            if not (self._fenced(fence) and all(self._holds(w) for w in writes)):
                return False
            if writes:
                self._revision += 1
            for w in writes:
                if w.lease_id and w.lease_id not in self._leases:
                    raise EtcdUnavailableError(f"lease {w.lease_id} not found")
                if w.value is None and w.prefix:
                    for key in [k for k in self._data if k.startswith(w.key)]:
                        del self._data[key]
                elif w.value is None:
                    self._data.pop(w.key, None)
                else:
                    self._data[w.key] = (w.value, self._revision, w.lease_id)
            return True

    def put(self, key: str, value: bytes, *, lease_id: int = 0) -> None:
        self.commit([Write(key, value, None, lease_id)])

    def lease_grant(self, ttl_s: int) -> int:
        with self._lock:
            self._check()
            lease_id = next(self._ids)
            self._leases[lease_id] = (self._clock() + ttl_s, ttl_s)
            return lease_id

    def lease_refresh(self, lease_id: int) -> bool:
        with self._lock:
            self._check()
            if lease_id not in self._leases:
                return False
            ttl = self._leases[lease_id][1]
            self._leases[lease_id] = (self._clock() + ttl, ttl)
            return True

    def lease_revoke(self, lease_id: int) -> None:
        with self._lock:
            self._check()
            self._drop_lease(lease_id)

    def healthy(self) -> bool:
        return self.available
