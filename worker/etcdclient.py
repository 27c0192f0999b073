"""The project's one etcd v3 client (torch-free): the control plane's state store, the torchrun
rendezvous and the workers' recovery group all talk to etcd through it (it lives in ``worker``
because ``worker`` never imports ``service``; the service imports it from here).

It speaks etcd's grpc-gateway JSON API (``/v3/...``) through ``etcd3gw``'s HTTP client: keys and
values travel base64-encoded, a key range ends at :func:`range_end`. The members are tried in
order, moving on when one refuses the connection or times out; the member that answered last is
tried first next time. A request that timed out may have been applied: it is sent to the next
member only when it is ``replay_safe`` (a read, or a transaction whose compare makes a replay
harmless); a counter's compare-and-set passes ``replay_safe=False``. TLS: a CA bundle and a
client certificate apply to every member.

Errors: :class:`EtcdUnavailableError` when no member answered, :class:`EtcdRefusedError` (a
subclass) when a member answered with an error (a lease that expired, a request etcd refuses).

Authentication (etcd's own users and roles): with :class:`Credentials` the client asks
``/v3/auth/authenticate`` for a token at its first request and sends it as the
``Authorization`` header of every request. etcd's simple tokens expire after
``--auth-token-ttl`` (300 s) without use, die with their user, and may be refused once the auth
store changed ("revision of auth store is old"): a request refused for its token is sent once
more with a fresh one (it was not applied). The password never leaves this object (``repr``
hides it) and never appears in an error.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client

from worker.errors import ElastrainError

DEFAULT_PORT = 2379


class EtcdUnavailableError(ElastrainError):
    """etcd cannot be reached or has no quorum; retry later."""


class EtcdRefusedError(EtcdUnavailableError):
    """An etcd member answered a request with an error (``detail`` is etcd's own text)."""

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


@dataclass(frozen=True, slots=True)
class EtcdEndpoint:
    """One etcd member's client URL, split."""

    protocol: str
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.protocol}://{host}:{self.port}"

    @classmethod
    def from_url(cls, url: str) -> EtcdEndpoint:
        """``http(s)://HOST[:PORT]`` (the form ``--etcd`` takes); raises ValueError otherwise."""
        parsed = urlparse(url.strip())
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"etcd endpoint {url!r} is not of the form http://HOST:PORT")
        return cls(parsed.scheme, parsed.hostname, parsed.port or DEFAULT_PORT)


@dataclass(frozen=True, slots=True)
class Credentials:
    """An etcd user and its password (``repr`` hides the password)."""

    user: str
    password: str = field(repr=False)


# etcd 3.5 words "the auth store changed since this token" two ways: the gRPC error
# (ErrAuthOldRevision) and the gateway's own check of the token's revision header.
_TOKEN_REFUSED = (
    "invalid auth token",
    "revision of auth store is old",
    "revision in header is old",
    "user name is empty",
)


def token_refused(detail: str) -> bool:
    """Whether etcd refused a request for its token (a fresh token may pass): expired, its user
    gone or changed, the auth store changed, or none sent."""
    return any(reason in detail for reason in _TOKEN_REFUSED)


def b64(data: str | bytes) -> str:
    """A key or value as the gateway takes it."""
    return base64.b64encode(data.encode("utf-8") if isinstance(data, str) else data).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def range_end(prefix: str) -> str:
    """The exclusive end of the key range of every key that starts with ``prefix``."""
    raw = bytearray(prefix.encode("utf-8"))
    raw[-1] += 1
    return bytes(raw).decode("utf-8")


class EtcdClient:
    """etcd v3 over the grpc-gateway, with member failover, leases and TLS options."""

    def __init__(
        self,
        endpoints: Sequence[EtcdEndpoint],
        *,
        timeout_s: float = 5.0,
        ca_cert: str | None = None,
        cert: tuple[str, str] | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("give at least one etcd endpoint")
        self.endpoints = tuple(endpoints)
        self._clients = [_member(e, timeout_s, ca_cert, cert) for e in self.endpoints]
        self._current = 0
        self.credentials = credentials
        self._token: str | None = None
        self._token_lock = threading.Lock()

    # -- transport -----------------------------------------------------------------------
    def post(self, path: str, body: dict[str, Any], *, replay_safe: bool = True) -> dict[str, Any]:
        """POST ``body`` to ``/v3/<path>`` of the first member that answers (authenticated when
        the client has credentials; a request refused for its token goes once more with a new one)."""
        if self.credentials is None:
            return self._post(path, body, replay_safe=replay_safe, token=None)
        token = self._token or self._authenticate(stale=None)
        try:
            return self._post(path, body, replay_safe=replay_safe, token=token)
        except EtcdRefusedError as exc:
            if not token_refused(exc.detail):
                raise
        return self._post(path, body, replay_safe=replay_safe, token=self._authenticate(stale=token))

    def _authenticate(self, *, stale: str | None) -> str:
        """A token for the credentials (a new one unless another thread replaced ``stale``)."""
        assert self.credentials is not None
        with self._token_lock:
            if self._token is not None and self._token != stale:
                return self._token
            answer = self._post(
                "auth/authenticate",
                {"name": self.credentials.user, "password": self.credentials.password},
                replay_safe=True,
                token=None,
            )
            self._token = str(answer["token"])
            return self._token

    def _post(
        self, path: str, body: dict[str, Any], *, replay_safe: bool, token: str | None
    ) -> dict[str, Any]:
        headers = {"Authorization": token} if token else None
        errors: list[str] = []
        start = self._current
        for step in range(len(self._clients)):
            index = (start + step) % len(self._clients)
            client = self._clients[index]
            url = self.endpoints[index].url
            try:
                result = dict(client.post(client.get_url(path), json=body, headers=headers))
            except etcd_errors.ConnectionFailedError as exc:
                errors.append(f"{url}: connection failed ({_detail(exc)})")
                continue
            except etcd_errors.ConnectionTimeoutError as exc:
                errors.append(f"{url}: timed out ({_detail(exc)})")
                if not replay_safe:
                    break
                continue
            except etcd_errors.Etcd3Exception as exc:
                detail = _detail(exc)
                if path == "auth/authenticate":  # the text names the user; say what to fix instead
                    raise EtcdRefusedError(
                        f"etcd refused the credentials of user {self.credentials.user!r} "  # type: ignore[union-attr]
                        f"({detail}); check the etcd user and password settings",
                        detail=detail,
                    ) from None
                raise EtcdRefusedError(f"etcd refused {path}: {detail}", detail=detail) from None
            self._current = index
            return result
        raise EtcdUnavailableError(
            "etcd is unreachable: no member answered at "
            + ", ".join(e.url for e in self.endpoints)
            + " ("
            + "; ".join(errors)
            + "); check that etcd is running and reachable"
        )

    # -- keys ----------------------------------------------------------------------------
    def range(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.post("kv/range", body)

    def put(self, key: str, value: bytes, *, lease: int = 0) -> dict[str, Any]:
        return self.post("kv/put", put_request(key, value, lease=lease))

    def txn(self, body: dict[str, Any], *, replay_safe: bool = True) -> dict[str, Any]:
        return self.post("kv/txn", body, replay_safe=replay_safe)

    def delete_range(self, key: str, *, prefix: bool = False) -> int:
        body = {"key": b64(key)}
        if prefix:
            body["range_end"] = b64(range_end(key))
        return int(self.post("kv/deleterange", body).get("deleted", 0))

    # -- leases --------------------------------------------------------------------------
    def lease_grant(self, ttl_s: int) -> int:
        return int(self.post("lease/grant", {"TTL": ttl_s, "ID": 0})["ID"])

    def lease_keepalive(self, lease_id: int) -> int:
        """The lease's remaining TTL after the refresh; 0 or less once it has expired."""
        result = self.post("lease/keepalive", {"ID": str(lease_id)}).get("result", {})
        return int(result.get("TTL", -1))

    def lease_revoke(self, lease_id: int) -> None:
        """Idempotent: revoking an expired or unknown lease is not an error."""
        try:
            self.post("kv/lease/revoke", {"ID": str(lease_id)})
        except EtcdRefusedError as exc:
            if "not found" not in exc.detail:
                raise

    def close(self) -> None:
        for client in self._clients:
            client.session.close()


def put_request(key: str, value: bytes, *, lease: int = 0) -> dict[str, Any]:
    """The body of a put (also a txn's ``request_put``)."""
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def is_lease_not_found(exc: EtcdRefusedError) -> bool:
    return "lease not found" in exc.detail


def _detail(exc: etcd_errors.Etcd3Exception) -> str:
    return str(exc.detail_text or exc)[:200]


def _member(
    endpoint: EtcdEndpoint, timeout_s: float, ca_cert: str | None, cert: tuple[str, str] | None
) -> Etcd3Client:
    # One session per member, pooled for the API's thread pool (several requests at a time).
    session = requests.Session()
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=64)
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    if ca_cert is not None:
        session.verify = ca_cert
    if cert is not None:
        session.cert = cert
    return Etcd3Client(
        host=endpoint.host,
        port=endpoint.port,
        protocol=endpoint.protocol,
        timeout=timeout_s,
        api_path="/v3/",
        session=session,
    )
