""":class:`worker.recovery.membership.KeyValue` on etcd, through the project's one etcd client
(:mod:`worker.etcdclient`). Torch-free; imports no service code.

:func:`from_env` builds it the way the service launches a peer-mode worker: through the job's
key-value gateway, ``ELASTRAIN_KV_GATEWAY`` (the service's URL of it), with the job's worker
token; the job's keys are confined to ``/elastrain/rdzv/<job id>/``. Without a gateway, the
members of ``ELASTRAIN_ETCD_ENDPOINTS`` (comma-separated ``http(s)://HOST:PORT``, an etcd
without auth), over TLS with the files of ``ELASTRAIN_ETCD_CA_CERT``, ``ELASTRAIN_ETCD_CERT``
and ``ELASTRAIN_ETCD_KEY`` when those are set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from worker.errors import SpecError
from worker.etcdclient import (
    GATEWAY_ENV,
    Credentials,
    EtcdClient,
    EtcdEndpoint,
    EtcdRefusedError,
    EtcdTLS,
    EtcdUnavailableError,
    b64,
    gateway_bearer,
    is_lease_not_found,
    put_request,
    range_end,
    unb64,
)
from worker.recovery.membership import KeyValueUnavailable, Stamped

T = TypeVar("T")


def _guard(call: Callable[[], T]) -> T:
    try:
        return call()
    except EtcdUnavailableError as exc:  # EtcdRefusedError too: the caller retries or falls back
        raise KeyValueUnavailable(str(exc)) from None


class EtcdKeyValue:
    """The group's keys on etcd (see the module docstring)."""

    def __init__(self, client: EtcdClient) -> None:
        self.client = client

    def get(self, key: str) -> Stamped | None:
        kvs = _guard(lambda: self.client.range({"key": b64(key)})).get("kvs", [])
        if not kvs:
            return None
        return Stamped(unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]))

    def compare_and_set(self, key: str, value: bytes, *, revision: int, lease: int = 0) -> bool:
        target, field = ("MOD", "mod_revision") if revision else ("CREATE", "create_revision")
        body: dict[str, Any] = {
            "compare": [{"key": b64(key), "result": "EQUAL", "target": target, field: str(revision)}],
            "success": [{"request_put": put_request(key, value, lease=lease)}],
            "failure": [],
        }
        return bool(_guard(lambda: self.client.txn(body)).get("succeeded", False))

    def put(self, key: str, value: bytes, *, lease: int = 0) -> None:
        _guard(lambda: self.client.put(key, value, lease=lease))

    def list_prefix(self, prefix: str) -> list[tuple[str, Stamped]]:
        body = {"key": b64(prefix), "range_end": b64(range_end(prefix))}
        kvs = _guard(lambda: self.client.range(body)).get("kvs", [])
        return [
            (unb64(kv["key"]).decode(), Stamped(unb64(kv.get("value", "")), int(kv["mod_revision"])))
            for kv in kvs
        ]

    def delete(self, key: str) -> None:
        _guard(lambda: self.client.delete_range(key))

    def lease_grant(self, ttl_s: int) -> int:
        return _guard(lambda: self.client.lease_grant(ttl_s))

    def lease_keepalive(self, lease: int) -> bool:
        try:
            return self.client.lease_keepalive(lease) > 0
        except EtcdRefusedError as exc:
            if is_lease_not_found(exc):
                return False
            raise KeyValueUnavailable(str(exc)) from None
        except EtcdUnavailableError as exc:
            raise KeyValueUnavailable(str(exc)) from None

    def lease_revoke(self, lease: int) -> None:
        _guard(lambda: self.client.lease_revoke(lease))

    def close(self) -> None:
        self.client.close()


def connect(
    endpoints: str,
    *,
    env: Mapping[str, str] | None = None,
    credentials: Credentials | None = None,
    tls: EtcdTLS | None = None,
    timeout_s: float = 5.0,
    name: str = "ELASTRAIN_ETCD_ENDPOINTS",
) -> EtcdKeyValue:
    """An :class:`EtcdKeyValue` on ``endpoints`` (comma-separated URLs: etcd members, or one
    key-value gateway, which takes ``ELASTRAIN_WORKER_TOKEN`` from ``env``). Raises
    :class:`SpecError` naming a malformed endpoint (as the variable ``name``)."""
    urls = [u.strip() for u in endpoints.split(",") if u.strip()]
    if not urls:
        raise SpecError(f"{GATEWAY_ENV} is not set: peer recovery needs the job's key-value gateway")
    try:
        members = [EtcdEndpoint.from_url(u) for u in urls]
        bearer = gateway_bearer(members, env or {})
    except ValueError as exc:
        raise SpecError(f"{name}: {exc}") from None
    client = EtcdClient(members, timeout_s=timeout_s, credentials=credentials, tls=tls, bearer=bearer)
    return EtcdKeyValue(client)


def from_env(env: Mapping[str, str]) -> EtcdKeyValue:
    """The adapter the service's launch environment describes (see the module docstring)."""
    if env.get(GATEWAY_ENV):
        return connect(env[GATEWAY_ENV], env=env, name=GATEWAY_ENV)
    try:
        tls = EtcdTLS.from_env(env)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    return connect(env.get("ELASTRAIN_ETCD_ENDPOINTS", ""), env=env, tls=tls)
