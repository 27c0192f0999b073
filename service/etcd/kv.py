"""The control plane's state store: a small key-value interface with compare-and-set writes.

Every write that can race is a :class:`Write` with the ``mod_revision`` it expects (0 means
"the key must not exist"); :meth:`KVStore.commit` applies a list of writes all or nothing. A
:class:`Fence` adds one more condition: the leader key still holds this leader's id on this
leader's lease, so a leader that lost its lease (a stale leader) cannot write.

:class:`EtcdStore` is the store on etcd, through the project's one etcd client
(:mod:`worker.etcdclient`; sync HTTP, the API calls it from a thread pool).
:class:`service.etcd.memory.MemoryStore` has the same semantics in memory for tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from worker.etcdclient import (
    Credentials,
    EtcdClient,
    EtcdEndpoint,
    EtcdTLS,
    EtcdUnavailableError,
    b64,
    put_request,
    range_end,
    unb64,
)

LEADER_KEY = "/elastrain/leader"


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
    :class:`worker.etcdclient.EtcdUnavailableError` when the store cannot answer."""

    def get(self, key: str) -> Versioned | None: ...

    def list_prefix(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 0,
        keys_only: bool = False,
        last: str | None = None,
    ) -> list[Entry]:
        """Keys under ``prefix`` in key order, after ``start_after`` when given and up to ``last``
        (included) when given; ``limit`` 0 = all; ``keys_only``: every value is ``b""`` (etcd
        sends none)."""
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


PAGE = 1000
"""Keys per range read of :func:`read_all` (bounds one answer's size)."""
FEW = 8
"""Up to this many jobs' keys are read one job's prefix at a time; more, in one :func:`read_all`."""


def read_all(
    store: KVStore,
    prefix: str,
    *,
    page: int = PAGE,
    keys_only: bool = False,
    first: str | None = None,
    last: str | None = None,
) -> list[Entry]:
    """Every key under ``prefix`` in key order, one range read per ``page`` keys (``keys_only``:
    their revisions, no value). ``first`` and ``last`` (both included) bound the keys: the reads
    start at ``first`` and stop once past ``last``."""
    out: list[Entry] = []
    after: str | None = None
    if first is not None:
        found = store.get(first)
        if found is not None:
            out.append(Entry(first, b"" if keys_only else found.value, found.mod_revision))
        after = first
    while True:
        batch = store.list_prefix(prefix, start_after=after, limit=page, keys_only=keys_only, last=last)
        out += batch
        if len(batch) < page or (last is not None and batch[-1].key >= last):
            return out
        after = batch[-1].key


# --------------------------------------------------------------------------- etcd


def _compares(writes: Iterable[Write], fence: Fence | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for w in writes:
        if w.expected is None:
            continue
        target = "MOD" if w.expected else "CREATE"
        field = "mod_revision" if w.expected else "create_revision"
        out.append({"key": b64(w.key), "result": "EQUAL", "target": target, field: str(w.expected)})
    if fence is not None:
        key = b64(fence.key)
        out.append({"key": key, "result": "EQUAL", "target": "VALUE", "value": b64(fence.holder)})
        out.append({"key": key, "result": "EQUAL", "target": "LEASE", "lease": str(fence.lease_id)})
    return out


def _request(w: Write) -> dict[str, Any]:
    if w.value is None:
        deleted = {"key": b64(w.key)}
        if w.prefix:
            deleted["range_end"] = b64(range_end(w.key))
        return {"request_delete_range": deleted}
    return {"request_put": put_request(w.key, w.value, lease=w.lease_id)}


def txn_body(writes: Sequence[Write], fence: Fence | None) -> dict[str, Any]:
    """The etcd transaction of :meth:`KVStore.commit`: every condition, then every write. Pure."""
    return {"compare": _compares(writes, fence), "success": [_request(w) for w in writes], "failure": []}


class EtcdStore:
    """:class:`KVStore` on etcd v3. ``endpoints``: one or more ``http://host:port`` (a list, or
    comma-separated); a request that cannot connect moves on to the next endpoint. ``tls``: the
    CA and client certificate for ``https://`` members."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        timeout_s: float = 5.0,
        credentials: Credentials | None = None,
        tls: EtcdTLS | None = None,
    ) -> None:
        urls = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        urls = [u.strip() for part in urls for u in part.split(",") if u.strip()]
        if not urls:
            raise EtcdUnavailableError("no etcd endpoint given; pass --etcd http://HOST:PORT")
        try:
            members = [EtcdEndpoint.from_url(u) for u in urls]
        except ValueError as exc:
            raise EtcdUnavailableError(str(exc)) from None
        self.client = EtcdClient(members, timeout_s=timeout_s, credentials=credentials, tls=tls)

    def get(self, key: str) -> Versioned | None:
        kvs = self.client.range({"key": b64(key)}).get("kvs", [])
        if not kvs:
            return None
        return Versioned(unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]))

    def list_prefix(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 0,
        keys_only: bool = False,
        last: str | None = None,
    ) -> list[Entry]:
        start = (start_after + "\0") if start_after is not None else prefix
        end = range_end(prefix)
        if last is not None:  # the smallest key after ``last``, when that ends the range sooner
            end = min(end.encode(), (last + "\0").encode()).decode()
        body: dict[str, Any] = {"key": b64(start), "range_end": b64(end)}
        if limit:
            body["limit"] = limit
        if keys_only:
            body["keys_only"] = True
        kvs = self.client.range(body).get("kvs", [])
        return [
            Entry(unb64(kv["key"]).decode(), unb64(kv.get("value", "")), int(kv["mod_revision"]))
            for kv in kvs
        ]

    def commit(self, writes: Sequence[Write], *, fence: Fence | None = None) -> bool:
        return bool(self.client.txn(txn_body(writes, fence)).get("succeeded", False))

    def put(self, key: str, value: bytes, *, lease_id: int = 0) -> None:
        self.client.put(key, value, lease=lease_id)

    def lease_grant(self, ttl_s: int) -> int:
        return self.client.lease_grant(ttl_s)

    def lease_refresh(self, lease_id: int) -> bool:
        return self.client.lease_keepalive(lease_id) > 0

    def lease_revoke(self, lease_id: int) -> None:
        self.client.lease_revoke(lease_id)

    def healthy(self) -> bool:
        try:
            self.client.range({"key": b64(LEADER_KEY), "count_only": True})
        except EtcdUnavailableError:
            return False
        return True
