"""The etcd operations the rendezvous needs: compare-and-set on ``mod_revision`` under one lease
per process, on the project's one etcd client (:mod:`worker.etcdclient`). Torch-free.

Every write carries this process's lease, so the keys of a rendezvous disappear ``ttl`` seconds
after the last live node stopped rewriting them; while any node lives, its keep-alives rewrite
the state key and re-attach it to that node's lease. The lease is refreshed lazily on writes (no
thread): every process that writes also heartbeats every few seconds. A lease that expired
meanwhile is replaced and the write sent again.

Failover is the client's: a compare-and-set may be retried on another member (its compare
makes a replay harmless); :meth:`EtcdKV.cas` callers that must not replay a write (a counter)
pass ``replay_safe=False``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

from worker.etcdclient import (
    Credentials,
    EtcdClient,
    EtcdEndpoint,
    EtcdRefusedError,
    EtcdTLS,
    b64,
    is_lease_not_found,
    put_request,
    range_end,
    unb64,
)

T = TypeVar("T")


class KeyValue(NamedTuple):
    value: bytes
    mod_revision: int


def cas_txn(key: str, value: bytes, expected_revision: int | None, lease: int | None) -> dict[str, Any]:
    """The txn that puts ``value`` iff ``key``'s mod_revision is ``expected_revision``
    (iff the key is absent when ``None``), and otherwise reads the key."""
    if expected_revision is None:
        compare = {"key": b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
    else:
        compare = {
            "key": b64(key),
            "result": "EQUAL",
            "target": "MOD",
            "mod_revision": str(expected_revision),
        }
    return {
        "compare": [compare],
        "success": [{"request_put": put_request(key, value, lease=lease or 0)}],
        "failure": [{"request_range": {"key": b64(key)}}],
    }


def parse_kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(unb64(item.get("value", "")), int(item.get("mod_revision", 0)))


def parse_cas(resp: dict[str, Any], value: bytes) -> tuple[bool, KeyValue | None]:
    """Read a :func:`cas_txn` response: (True, what we wrote) or (False, what is there)."""
    # proto3 JSON leaves out false booleans and empty lists.
    if resp.get("succeeded", False):
        return True, KeyValue(value, int(resp["header"]["revision"]))
    responses = resp.get("responses") or [{}]
    kvs = responses[0].get("response_range", {}).get("kvs") or []
    return False, (parse_kv(kvs[0]) if kvs else None)


def all_exist_txn(keys: Sequence[str]) -> dict[str, Any]:
    """A txn that succeeds iff every key exists (and changes nothing)."""
    compare = [
        {"key": b64(key), "result": "GREATER", "target": "CREATE", "create_revision": "0"} for key in keys
    ]
    return {"compare": compare, "success": [], "failure": []}


class EtcdKV:
    """Keys and values in etcd with compare-and-set, failover across members and a lease."""

    def __init__(
        self,
        endpoints: Sequence[EtcdEndpoint],
        *,
        lease_ttl: int,
        read_timeout: float,
        tls: EtcdTLS | None = None,
        credentials: Credentials | None = None,
        bearer: str | None = None,
    ) -> None:
        self._client = EtcdClient(
            endpoints, timeout_s=read_timeout, tls=tls, credentials=credentials, bearer=bearer
        )
        self._lease_ttl = lease_ttl
        self._lease_id: int | None = None
        self._lease_refreshed = 0.0
        self._lock = threading.Lock()

    @property
    def endpoints(self) -> tuple[EtcdEndpoint, ...]:
        return self._client.endpoints

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        kvs = self._client.range({"key": b64(key)}).get("kvs") or []
        return parse_kv(kvs[0]) if kvs else None

    def all_exist(self, keys: Sequence[str]) -> bool:
        if not keys:
            return True
        return bool(self._client.txn(all_exist_txn(keys)).get("succeeded", False))

    def count(self, prefix: str) -> int:
        body = {"key": b64(prefix), "range_end": b64(range_end(prefix)), "count_only": True}
        return int(self._client.range(body).get("count", 0))

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> int:
        """Put unconditionally; returns the new revision."""
        resp = self._leased(lambda lease: self._client.put(key, value, lease=lease))
        return int(resp["header"]["revision"])

    def cas(
        self, key: str, value: bytes, expected_revision: int | None, *, replay_safe: bool = True
    ) -> tuple[bool, KeyValue | None]:
        """Put ``value`` iff the key's mod_revision is ``expected_revision`` (absent if ``None``).

        Returns (True, the value and its new revision) or (False, the current value, or
        ``None`` if the key is absent)."""
        resp = self._leased(
            lambda lease: self._client.txn(
                cas_txn(key, value, expected_revision, lease), replay_safe=replay_safe
            )
        )
        return parse_cas(resp, value)

    def delete(self, key: str) -> bool:
        return self._client.delete_range(key) > 0

    def delete_prefix(self, prefix: str) -> int:
        return self._client.delete_range(prefix, prefix=True)

    def close(self) -> None:
        """Forget the lease without revoking it: keys stay until their TTL (others may need them)."""
        with self._lock:
            self._lease_id = None
        self._client.close()

    # -- lease ---------------------------------------------------------------------------
    def _leased(self, write: Callable[[int], T]) -> T:
        lease = self._lease()
        try:
            return write(lease)
        except EtcdRefusedError as exc:
            if not is_lease_not_found(exc):
                raise
        with self._lock:
            self._lease_id = None
        return write(self._lease())

    def _lease(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._lease_id is not None and now - self._lease_refreshed > self._lease_ttl / 3:
                ttl = self._client.lease_keepalive(self._lease_id)
                self._lease_id = self._lease_id if ttl > 0 else None
                self._lease_refreshed = now
            if self._lease_id is None:
                self._lease_id = self._client.lease_grant(self._lease_ttl)
                self._lease_refreshed = now
            return self._lease_id
