"""The control plane's state store: a small key-value interface with compare-and-set writes.

Every write that can race is a :class:`Write` with the ``mod_revision`` it expects (0 means
"the key must not exist"); :meth:`KVStore.commit` applies a list of writes all or nothing. A
:class:`Fence` adds one more condition: the leader key still holds this leader's id on this
leader's lease, so a leader that lost its lease (a stale leader) cannot write.

``EtcdStore`` talks to etcd's v3 grpc-gateway through ``etcd3gw`` (sync HTTP; the async API
calls it from a thread pool). ``MemoryStore`` has the same semantics in memory, with an
injectable clock so tests can expire leases.
"""

from __future__ import annotations

import base64
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlparse

import requests
from etcd3gw import exceptions as etcd_exc
from etcd3gw.client import Etcd3Client

from worker.errors import ElastrainError

LEADER_KEY = "/elastrain/leader"


class StoreUnavailableError(ElastrainError):
    """The state store cannot be reached or has no quorum; retry later."""


class Versioned(NamedTuple):
    value: bytes
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Entry:
    key: str
    value: bytes
    mod_revision: int


@dataclass(frozen=True, slots=True)
class Write:
    """Put ``value`` (or delete when ``value`` is None) if the key's mod_revision equals
    ``expected`` (0: the key must not exist; None: no condition). ``prefix``: delete every key
    under ``key`` (only with ``value`` None and ``expected`` None)."""

    key: str
    value: bytes | None
    expected: int | None = 0
    lease_id: int = 0
    prefix: bool = False

    def __post_init__(self) -> None:
        if self.prefix and (self.value is not None or self.expected is not None):
            raise ValueError("a prefix Write deletes without a condition: value and expected must be None")


@dataclass(frozen=True, slots=True)
class Fence:
    """The writer is the leader: ``key`` holds ``holder`` attached to ``lease_id``."""

    holder: str
    lease_id: int
    key: str = LEADER_KEY


class KVStore(Protocol):
    """What the control plane needs from etcd. All methods raise
    :class:`StoreUnavailableError` when the store cannot answer."""

    def get(self, key: str) -> Versioned | None: ...

    def list_prefix(self, prefix: str, *, start_after: str | None = None, limit: int = 0) -> list[Entry]:
        """Keys under ``prefix`` in key order, after ``start_after`` when given; ``limit`` 0 = all."""
        ...

    def commit(self, writes: Sequence[Write], *, fence: Fence | None = None) -> bool:
        """Apply all writes atomically if every condition holds; False (nothing written) otherwise."""
        ...

    def put(self, key: str, value: bytes, *, lease_id: int = 0) -> None:
        """Unconditional write, for last-writer-wins data (heartbeats, progress)."""
        ...

    def lease_grant(self, ttl_s: int) -> int: ...

    def lease_refresh(self, lease_id: int) -> bool:
        """Keep a lease alive; False when it has already expired."""
        ...

    def lease_revoke(self, lease_id: int) -> None: ...

    def healthy(self) -> bool:
        """True when a linearizable read succeeds (the cluster has quorum)."""
        ...


def put_if(store: KVStore, key: str, value: bytes, expected: int, *, fence: Fence | None = None) -> bool:
    """Compare-and-set one key (``expected`` 0 = create)."""
    return store.commit([Write(key, value, expected)], fence=fence)


def delete_if(store: KVStore, key: str, expected: int, *, fence: Fence | None = None) -> bool:
    return store.commit([Write(key, None, expected)], fence=fence)


def prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return raw.decode()


def address_key(leader_key: str = LEADER_KEY) -> str:
    """The key holding the leader's address, written with the leader key on the same lease (it
    goes when the leadership does)."""
    return f"{leader_key}-address"


def leader_address(store: KVStore, leader_key: str = LEADER_KEY) -> str | None:
    """The address the current leader published, or None (no leader, or it published none)."""
    found = store.get(address_key(leader_key))
    return found.value.decode() if found is not None and found.value else None


class LeaderElection:
    """One leader at a time: the holder of ``LEADER_KEY`` on its own lease.

    ``campaign()`` returns the :class:`Fence` to pass to every leader write, or None while
    another holder is alive. ``keep_alive()`` returns False once leadership is lost (the
    lease expired or the key changed); the caller must then stop acting as leader.
    """

    def __init__(
        self,
        store: KVStore,
        holder: str,
        *,
        ttl_s: int = 10,
        key: str = LEADER_KEY,
        address: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.holder = holder
        self.address = address
        """Where the other instances reach this one: published with the leader key, on its lease."""
        self._ttl_s = ttl_s
        self._key = key
        self._clock = clock
        self._refreshed = float("-inf")
        self.fence: Fence | None = None

    @property
    def ttl_s(self) -> int:
        return self._ttl_s

    def campaign(self) -> Fence | None:
        """Held leadership is re-confirmed with etcd at most every ttl/3 (each confirmation is a
        lease refresh and a fenced read); a lease lost in between makes etcd refuse the writes."""
        if self.fence is not None and self._clock() - self._refreshed < self._ttl_s / 3:
            return self.fence
        if self.fence is not None and self.keep_alive():
            return self.fence
        current = self._store.get(self._key)
        if current is not None and current.value.decode() != self.holder:
            return None
        lease_id = self._store.lease_grant(self._ttl_s)
        expected = current.mod_revision if current is not None else 0
        writes = [Write(self._key, self.holder.encode(), expected, lease_id)]
        if self.address:
            writes.append(Write(address_key(self._key), self.address.encode(), None, lease_id))
        if self._store.commit(writes):
            self.fence = Fence(self.holder, lease_id, self._key)
            self._refreshed = self._clock()
            return self.fence
        self._store.lease_revoke(lease_id)
        return None

    def keep_alive(self) -> bool:
        fence = self.fence
        if fence is None:
            return False
        started = self._clock()
        held = self._store.lease_refresh(fence.lease_id) and self._store.commit([], fence=fence)
        if not held:
            self.fence = None
        else:
            self._refreshed = started
        return held

    def resign(self) -> None:
        """Give up leadership (idempotent): the next campaign of another holder wins at once."""
        fence, self.fence = self.fence, None
        if fence is not None:
            self._store.lease_revoke(fence.lease_id)


# --------------------------------------------------------------------------- etcd


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _compares(writes: Iterable[Write], fence: Fence | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for w in writes:
        if w.expected is None:
            continue
        target = "MOD" if w.expected else "CREATE"
        field = "mod_revision" if w.expected else "create_revision"
        out.append({"key": _b64(w.key), "result": "EQUAL", "target": target, field: str(w.expected)})
    if fence is not None:
        key = _b64(fence.key)
        out.append({"key": key, "result": "EQUAL", "target": "VALUE", "value": _b64(fence.holder)})
        out.append({"key": key, "result": "EQUAL", "target": "LEASE", "lease": str(fence.lease_id)})
    return out


def _request(w: Write) -> dict[str, Any]:
    if w.value is None:
        deleted = {"key": _b64(w.key)}
        if w.prefix:
            deleted["range_end"] = _b64(prefix_end(w.key))
        return {"request_delete_range": deleted}
    put: dict[str, Any] = {"key": _b64(w.key), "value": _b64(w.value)}
    if w.lease_id:
        put["lease"] = str(w.lease_id)
    return {"request_put": put}


class EtcdStore:
    """:class:`KVStore` on etcd v3 (grpc-gateway). ``endpoints``: one or more ``http://host:port``;
    a request that cannot connect moves on to the next endpoint."""

    def __init__(self, endpoints: str | Sequence[str], *, timeout_s: float = 5.0) -> None:
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        urls = [u.strip() for part in urls for u in part.split(",") if u.strip()]
        if not urls:
            raise StoreUnavailableError("no etcd endpoint given; pass --etcd http://HOST:PORT")
        self._clients = [self._client(u, timeout_s) for u in urls]
        self._current = 0

    @staticmethod
    def _client(url: str, timeout_s: float) -> Etcd3Client:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise StoreUnavailableError(f"etcd endpoint {url!r} is not of the form http://HOST:PORT")
        session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=64)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        return Etcd3Client(
            host=parsed.hostname,
            port=parsed.port or 2379,
            protocol=parsed.scheme,
            timeout=timeout_s,
            api_path="/v3/",
            session=session,
        )

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        errors = []
        for offset in range(len(self._clients)):
            index = (self._current + offset) % len(self._clients)
            client = self._clients[index]
            try:
                result: dict[str, Any] = client.post(client.get_url(path), json=payload)
            except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError) as exc:
                errors.append(f"{client.base_url}: {str(exc)[:120]}")
                continue
            except etcd_exc.Etcd3Exception as exc:
                raise StoreUnavailableError(f"etcd refused {path}: {str(exc)[:200]}") from None
            self._current = index
            return result
        raise StoreUnavailableError("etcd is unreachable (" + "; ".join(errors) + ")")

    def get(self, key: str) -> Versioned | None:
        kvs = self._post("kv/range", {"key": _b64(key)}).get("kvs", [])
        if not kvs:
            return None
        return Versioned(_unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]))

    def list_prefix(self, prefix: str, *, start_after: str | None = None, limit: int = 0) -> list[Entry]:
        start = (start_after + "\0") if start_after is not None else prefix
        payload: dict[str, Any] = {"key": _b64(start), "range_end": _b64(prefix_end(prefix))}
        if limit:
            payload["limit"] = limit
        kvs = self._post("kv/range", payload).get("kvs", [])
        return [
            Entry(_unb64(kv["key"]).decode(), _unb64(kv.get("value", "")), int(kv["mod_revision"]))
            for kv in kvs
        ]

    def commit(self, writes: Sequence[Write], *, fence: Fence | None = None) -> bool:
        txn = {"compare": _compares(writes, fence), "success": [_request(w) for w in writes], "failure": []}
        return bool(self._post("kv/txn", txn).get("succeeded", False))

    def put(self, key: str, value: bytes, *, lease_id: int = 0) -> None:
        self._post("kv/put", _request(Write(key, value, None, lease_id))["request_put"])

    def lease_grant(self, ttl_s: int) -> int:
        return int(self._post("lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])

    def lease_refresh(self, lease_id: int) -> bool:
        result = self._post("lease/keepalive", {"ID": str(lease_id)}).get("result", {})
        return int(result.get("TTL", -1)) > 0

    def lease_revoke(self, lease_id: int) -> None:
        try:
            self._post("kv/lease/revoke", {"ID": str(lease_id)})
        except StoreUnavailableError as exc:
            if "not found" not in str(exc):
                raise

    def healthy(self) -> bool:
        try:
            self._post("kv/range", {"key": _b64(LEADER_KEY), "count_only": True})
        except StoreUnavailableError:
            return False
        return True


# --------------------------------------------------------------------------- memory


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
            raise StoreUnavailableError("memory store marked unavailable")
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

    def list_prefix(self, prefix: str, *, start_after: str | None = None, limit: int = 0) -> list[Entry]:
        with self._lock:
            self._check()
            keys = sorted(k for k in self._data if k.startswith(prefix))
            if start_after is not None:
                keys = [k for k in keys if k > start_after]
            keys = keys[:limit] if limit else keys
            return [Entry(k, self._data[k][0], self._data[k][1]) for k in keys]

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
                    raise StoreUnavailableError(f"lease {w.lease_id} not found")
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
