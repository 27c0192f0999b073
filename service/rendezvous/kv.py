"""A small etcd v3 key-value client for the rendezvous: compare-and-set on ``mod_revision``,
member failover and one lease per process. Torch-free.

It speaks etcd's grpc-gateway JSON API through ``etcd3gw`` (the project's etcd client). Every
write carries this process's lease, so the keys of a rendezvous disappear ``ttl`` seconds after
the last live node stopped rewriting them; while any node lives, its keep-alives rewrite the
state key and re-attach it to that node's lease. The lease is refreshed lazily on writes (no
thread): every process that writes also heartbeats every few seconds.

Failover: the endpoints are tried in order, moving on when a member refuses the connection or
times out; the member that answered last is tried first next time. A compare-and-set may be
retried on another member (its compare makes a replay harmless); :meth:`EtcdKV.cas` callers
that must not replay a write (a counter) pass ``replay_safe=False``.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import etcd3gw
from etcd3gw import exceptions as etcd_errors

from service.rendezvous.config import EtcdEndpoint
from worker.errors import ElastrainError

T = TypeVar("T")


class EtcdUnavailableError(ElastrainError):
    """No etcd member answered (all refused, timed out or failed)."""


class KeyValue(NamedTuple):
    value: bytes
    mod_revision: int


def _b64(data: str | bytes) -> str:
    raw = data.encode("utf-8") if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _range_end(prefix: str) -> str:
    """The exclusive end of the key range that starts with ``prefix``."""
    raw = bytearray(prefix.encode("utf-8"))
    raw[-1] += 1
    return _b64(bytes(raw))


def cas_txn(key: str, value: bytes, expected_revision: int | None, lease: int | None) -> dict[str, Any]:
    """The txn that puts ``value`` iff ``key``'s mod_revision is ``expected_revision``
    (iff the key is absent when ``None``), and otherwise reads the key."""
    if expected_revision is None:
        compare = {"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
    else:
        compare = {
            "key": _b64(key),
            "result": "EQUAL",
            "target": "MOD",
            "mod_revision": str(expected_revision),
        }
    put: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease is not None:
        put["lease"] = str(lease)
    return {
        "compare": [compare],
        "success": [{"request_put": put}],
        "failure": [{"request_range": {"key": _b64(key)}}],
    }


def parse_kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(item.get("value", "")), int(item.get("mod_revision", 0)))


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
        {"key": _b64(key), "result": "GREATER", "target": "CREATE", "create_revision": "0"} for key in keys
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
        ca_cert: str | None = None,
        cert: tuple[str, str] | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("give at least one etcd endpoint")
        self._endpoints = tuple(endpoints)
        self._clients = [
            etcd3gw.Etcd3Client(
                host=e.host,
                port=e.port,
                protocol=e.protocol,
                ca_cert=ca_cert,
                cert_cert=cert[0] if cert else None,
                cert_key=cert[1] if cert else None,
                timeout=read_timeout,
                api_path="/v3/",
            )
            for e in self._endpoints
        ]
        self._current = 0
        self._lease_ttl = lease_ttl
        self._lease_id: int | None = None
        self._lease_refreshed = 0.0
        self._lock = threading.Lock()

    @property
    def endpoints(self) -> tuple[EtcdEndpoint, ...]:
        return self._endpoints

    # -- reads ---------------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        resp = self._post("/kv/range", {"key": _b64(key)})
        kvs = resp.get("kvs") or []
        return parse_kv(kvs[0]) if kvs else None

    def all_exist(self, keys: Sequence[str]) -> bool:
        if not keys:
            return True
        resp = self._post("/kv/txn", all_exist_txn(keys))
        return bool(resp.get("succeeded", False))

    def count(self, prefix: str) -> int:
        resp = self._post(
            "/kv/range", {"key": _b64(prefix), "range_end": _range_end(prefix), "count_only": True}
        )
        return int(resp.get("count", 0))

    # -- writes --------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> int:
        """Put unconditionally; returns the new revision."""
        resp = self._leased(lambda lease: self._post("/kv/put", _put_body(key, value, lease)))
        return int(resp["header"]["revision"])

    def cas(
        self, key: str, value: bytes, expected_revision: int | None, *, replay_safe: bool = True
    ) -> tuple[bool, KeyValue | None]:
        """Put ``value`` iff the key's mod_revision is ``expected_revision`` (absent if ``None``).

        Returns (True, the value and its new revision) or (False, the current value, or
        ``None`` if the key is absent)."""
        resp = self._leased(
            lambda lease: self._post(
                "/kv/txn", cas_txn(key, value, expected_revision, lease), replay_safe=replay_safe
            )
        )
        return parse_cas(resp, value)

    def delete(self, key: str) -> bool:
        resp = self._post("/kv/deleterange", {"key": _b64(key)})
        return int(resp.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: str) -> int:
        resp = self._post("/kv/deleterange", {"key": _b64(prefix), "range_end": _range_end(prefix)})
        return int(resp.get("deleted", 0))

    def close(self) -> None:
        """Forget the lease without revoking it: keys stay until their TTL (others may need them)."""
        with self._lock:
            self._lease_id = None
        for client in self._clients:
            client.session.close()

    # -- lease ---------------------------------------------------------------------------
    def _leased(self, write: Callable[[int], T]) -> T:
        lease = self._lease()
        try:
            return write(lease)
        except etcd_errors.Etcd3Exception as exc:
            if "lease not found" not in str(exc.detail_text or ""):
                raise
        with self._lock:
            self._lease_id = None
        return write(self._lease())

    def _lease(self) -> int:
        with self._lock:
            now = time.monotonic()
            if self._lease_id is not None and now - self._lease_refreshed > self._lease_ttl / 3:
                ttl = self._call(self._refresh)
                self._lease_id = self._lease_id if ttl > 0 else None
                self._lease_refreshed = now
            if self._lease_id is None:
                self._lease_id = self._call(lambda c: c.lease(self._lease_ttl).id)
                self._lease_refreshed = now
            return self._lease_id

    def _refresh(self, client: etcd3gw.Etcd3Client) -> int:
        assert self._lease_id is not None
        resp = client.post(client.get_url("/lease/keepalive"), json={"ID": self._lease_id})
        return int(resp.get("result", {}).get("TTL", -1))

    # -- transport -----------------------------------------------------------------------
    def _post(self, path: str, body: dict[str, Any], *, replay_safe: bool = True) -> dict[str, Any]:
        def call(client: etcd3gw.Etcd3Client) -> dict[str, Any]:
            return dict(client.post(client.get_url(path), json=body))

        return self._call(call, replay_safe=replay_safe)

    def _call(self, fn: Callable[[etcd3gw.Etcd3Client], T], *, replay_safe: bool = True) -> T:
        errors: list[str] = []
        start = self._current
        for step in range(len(self._clients)):
            index = (start + step) % len(self._clients)
            try:
                result = fn(self._clients[index])
            except etcd_errors.ConnectionFailedError as exc:
                errors.append(f"{self._endpoints[index].url}: connection failed ({exc.detail_text})")
                continue
            except etcd_errors.ConnectionTimeoutError as exc:
                errors.append(f"{self._endpoints[index].url}: timed out ({exc.detail_text})")
                if not replay_safe:
                    break
                continue
            self._current = index
            return result
        raise EtcdUnavailableError(
            "no etcd member answered; check that etcd is running and reachable at "
            + ", ".join(e.url for e in self._endpoints)
            + ": "
            + "; ".join(errors)
        )


def _put_body(key: str, value: bytes, lease: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease is not None:
        body["lease"] = str(lease)
    return body
