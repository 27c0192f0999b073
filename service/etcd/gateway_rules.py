"""What a job may ask of etcd through the service's key-value gateway: pure checks on plain values.

The threat: job code is untrusted (a poisoned dependency runs with whatever its process holds).
etcd gives any authenticated user ways out of a key-prefix role (etcd 3.5 lets any user raise the
NOSPACE alarm and skips permission checks while it is active; it lists leases with their keys to
any user), and a user that fills etcd raises that alarm for everyone. So jobs hold no etcd
credential and no etcd endpoint: their rendezvous and peer-mode keys go through the service
(:mod:`service.etcd.gateway`), which forwards a request only after these checks pass:

* **Operations**: :data:`OPERATIONS`, the ones the rendezvous and the peer group use (range,
  put, txn, deleterange, lease grant, keep-alive and revoke). Nothing else exists for a job: no
  maintenance (alarms), no ``auth/*``, no lease listing or lease time-to-live.
* **Keys**: every key and range end, in a request and in every compare and operation of a txn
  (nested txns included), lies inside the job's prefix; ``range_end`` ``"\\0"`` (everything
  after a key) is refused.
* **Fields**: each message's fields are allow-listed by their proto names; any other field
  (etcd's JSON gateway also accepts the camelCase spellings, e.g. ``rangeEnd``) is refused, so
  what was checked is what etcd reads. Keys and values are strict, padded base64.
* **Leases**: a job may keep alive, revoke or attach only leases granted to it through the
  gateway; a grant asks etcd to choose the id and its TTL is capped.
* **Budget**: a write is admitted only within the job's and all jobs' budgets.
  Both live in :mod:`service.etcd.gateway_budget`; a fill is refused with the budget's name,
  never an etcd quota alarm.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

OPERATIONS = frozenset(
    {"kv/range", "kv/put", "kv/txn", "kv/deleterange", "lease/grant", "lease/keepalive", "kv/lease/revoke"}
)
"""The etcd v3 JSON gateway paths a job may use (under ``/v1/jobs/{id}/kv/``)."""
WRITES = frozenset({"kv/put", "kv/txn", "kv/deleterange", "lease/grant", "kv/lease/revoke"})

_RANGE = frozenset(
    {"key", "range_end", "limit", "revision", "sort_order", "sort_target", "serializable", "keys_only",
     "count_only", "min_mod_revision", "max_mod_revision", "min_create_revision", "max_create_revision"}
)  # fmt: skip
_PUT = frozenset({"key", "value", "lease", "prev_kv", "ignore_value", "ignore_lease"})
_DELETE = frozenset({"key", "range_end", "prev_kv"})
_TXN = frozenset({"compare", "success", "failure"})
_COMPARE = frozenset(
    {"key", "range_end", "result", "target", "version", "create_revision", "mod_revision", "value", "lease"}
)
_REQUEST_OPS = {"request_range": _RANGE, "request_put": _PUT, "request_delete_range": _DELETE}
_LEASE_ID = frozenset({"ID"})
_GRANT = frozenset({"TTL", "ID"})
MAX_TXN_OPS = 128
"""Compares plus operations of one txn, nested ones included (etcd's own default limit)."""


class GatewayRefused(Exception):
    """A request the gateway will not forward: ``status`` (403: outside the job's keys or
    leases; 404: not an operation; 413: over a budget; 422: malformed) and a message that names
    what is wrong (and the budget, when it is one)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Put:
    """One write a request may make: its key and how many bytes it stores (key plus value)."""

    key: bytes
    size: int


@dataclass(frozen=True, slots=True)
class Checked:
    """What a checked request does: the leases it names and the puts it may make (both branches
    of a txn, as either may run)."""

    leases: tuple[int, ...] = ()
    puts: tuple[Put, ...] = ()

    @property
    def written_bytes(self) -> int:
        return sum(p.size for p in self.puts)


def prefix_end(prefix: bytes) -> bytes:
    """The exclusive end of the keys that start with ``prefix`` (a non-empty prefix)."""
    raw = bytearray(prefix)
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        raise ValueError("a prefix of 0xff bytes has no end")
    raw[-1] += 1
    return bytes(raw)


def check_request(op: str, body: Mapping[str, Any], prefix: str) -> Checked:
    """Check one request of a job whose keys live under ``prefix``; raises
    :class:`GatewayRefused` naming the operation, field or key. Pure."""
    if op not in OPERATIONS:
        allowed = ", ".join(sorted(OPERATIONS))
        raise GatewayRefused(
            404,
            "not_found",
            f"{op!r} is not an operation a job may use through the gateway; it serves {allowed}",
        )
    scope = _Scope(prefix.encode())
    if op == "kv/range":
        scope.range(body, "kv/range")
    elif op == "kv/put":
        scope.put(body, "kv/put")
    elif op == "kv/deleterange":
        scope.range(body, "kv/deleterange", fields=_DELETE)
    elif op == "kv/txn":
        scope.txn(body, "kv/txn", depth=0)
    elif op == "lease/grant":
        _fields(body, _GRANT, op)
        if _int(body.get("ID", 0), f"{op}.ID") != 0:
            raise GatewayRefused(403, "forbidden", "lease/grant: leave ID out (etcd chooses a lease's id)")
        _int(body.get("TTL"), f"{op}.TTL")
    else:  # lease/keepalive, kv/lease/revoke
        _fields(body, _LEASE_ID, op)
        scope.leases.append(_int(body.get("ID"), f"{op}.ID"))
    return Checked(tuple(scope.leases), tuple(scope.puts))


@dataclass(slots=True)
class _Scope:
    prefix: bytes
    leases: list[int] = field(default_factory=list)
    puts: list[Put] = field(default_factory=list)
    count: int = 0

    def key(self, body: Mapping[str, Any], where: str) -> bytes:
        key = _b64(body.get("key"), f"{where}.key")
        if not key.startswith(self.prefix):
            raise GatewayRefused(
                403, "forbidden", f"{where}: key {_show(key)} is outside this job's keys {_show(self.prefix)}"
            )
        return key

    def range(self, body: Mapping[str, Any], where: str, *, fields: frozenset[str] = _RANGE) -> None:
        _fields(body, fields, where)
        self.key(body, where)
        if "range_end" in body:
            end = _b64(body["range_end"], f"{where}.range_end", empty=True)
            if end and not (self.prefix < end <= prefix_end(self.prefix)):
                raise GatewayRefused(
                    403,
                    "forbidden",
                    f"{where}: range_end {_show(end)} reaches outside this job's keys {_show(self.prefix)}",
                )

    def put(self, body: Mapping[str, Any], where: str) -> None:
        _fields(body, _PUT, where)
        key = self.key(body, where)
        value = _b64(body.get("value", ""), f"{where}.value", empty=True)
        lease = _int(body.get("lease", 0), f"{where}.lease")
        if lease:
            self.leases.append(lease)
        self.puts.append(Put(key, len(key) + len(value)))

    def txn(self, body: Mapping[str, Any], where: str, *, depth: int) -> None:
        _fields(body, _TXN, where)
        if depth > 4:
            raise GatewayRefused(422, "invalid", f"{where}: txns nested deeper than 4")
        for i, compare in enumerate(_list(body.get("compare"), f"{where}.compare")):
            self._tick(where)
            self.range(_object(compare, f"{where}.compare[{i}]"), f"{where}.compare[{i}]", fields=_COMPARE)
            lease = _int(compare.get("lease", 0), f"{where}.compare[{i}].lease")
            if lease:
                self.leases.append(lease)
        for branch in ("success", "failure"):
            for i, item in enumerate(_list(body.get(branch), f"{where}.{branch}")):
                self._tick(where)
                self.request(_object(item, f"{where}.{branch}[{i}]"), f"{where}.{branch}[{i}]", depth)

    def request(self, item: Mapping[str, Any], where: str, depth: int) -> None:
        if len(item) != 1:
            raise GatewayRefused(
                422,
                "invalid",
                f"{where}: give exactly one of request_range, request_put, request_delete_range, request_txn",
            )
        ((kind, inner),) = item.items()
        body = _object(inner, f"{where}.{kind}")
        if kind == "request_put":
            self.put(body, f"{where}.{kind}")
        elif kind == "request_txn":
            self.txn(body, f"{where}.{kind}", depth=depth + 1)
        elif kind in _REQUEST_OPS:
            self.range(body, f"{where}.{kind}", fields=_REQUEST_OPS[kind])
        else:
            raise GatewayRefused(422, "invalid", f"{where}: unknown operation {kind!r}")

    def _tick(self, where: str) -> None:
        self.count += 1
        if self.count > MAX_TXN_OPS:
            raise GatewayRefused(422, "invalid", f"{where}: more than {MAX_TXN_OPS} compares and operations")


def _fields(body: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise GatewayRefused(
            422,
            "invalid",
            f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}",
        )


def _b64(value: Any, where: str, *, empty: bool = False) -> bytes:
    if not isinstance(value, str) or (not value and not empty):
        raise GatewayRefused(422, "invalid", f"{where}: give a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise GatewayRefused(422, "invalid", f"{where}: not padded standard base64") from None


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise GatewayRefused(422, "invalid", f"{where}: give an integer")
    text = str(value)
    if not (text.isascii() and text.lstrip("-").isdigit()):
        raise GatewayRefused(422, "invalid", f"{where}: give an integer")
    return int(text)


def _list(value: Any, where: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise GatewayRefused(422, "invalid", f"{where}: give a list")
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise GatewayRefused(422, "invalid", f"{where}: give an object")
    return value


def _show(raw: bytes) -> str:
    return repr(raw.decode("utf-8", "replace")[:120])
