"""The project's one etcd v3 client (torch-free): the control plane's state store, the torchrun
rendezvous and the workers' recovery group all talk to etcd through it (it lives in ``worker``
because ``worker`` never imports ``service``; the service imports it from here).

It speaks etcd's grpc-gateway JSON API (``/v3/...``) over HTTP/1.1 keep-alive connections of
the standard library's ``http.client`` (a pool per member, shared by the threads): keys and
values travel base64-encoded, a key range ends at :func:`range_end`. The members are tried in
order, moving on when one cannot be connected to or times out; the member that answered last is
tried first next time. A request whose connection failed after it was sent may have been
applied: it is sent to the next member only when it is ``replay_safe`` (a read, or a
transaction whose compare makes a replay harmless); a counter's compare-and-set passes
``replay_safe=False``. TLS: a CA bundle (the system's when none is given) and a client
certificate apply to every member. Proxy variables (``HTTP_PROXY``...) are not read: etcd is
reached directly, as etcd's own clients do.

Why not ``requests``: a request through its session cost 1.37 ms of CPU here, against 0.29 ms
through this client and 0.27 ms for a bare ``http.client`` request (``benchmarks/etcd_client.py``:
the session's environment merge, its hooks and urllib3's layers); the workers' recovery writes
to etcd while the group trains, on the same cores.

Errors: :class:`EtcdUnavailableError` when no member answered, :class:`EtcdRefusedError` (a
subclass) when a member answered with an error (a lease that expired, a request etcd refuses).

Authentication (etcd's own users and roles): with :class:`Credentials` the client asks
``/v3/auth/authenticate`` for a token at its first request and sends it as the
``Authorization`` header of every request. etcd's simple tokens expire after
``--auth-token-ttl`` (300 s) without use, die with their user, and may be refused once the auth
store changed ("revision of auth store is old"): a request refused for its token is sent once
more with a fresh one (it was not applied). The password never leaves this object (``repr``
hides it) and never appears in an error.

Gateway mode: under the service a job holds no etcd endpoint or credential; its endpoint is
the service's key-value gateway of that job (``http://svc:8080/v1/jobs/J/kv``, see
``service.etcd.gateway``), which takes the same JSON bodies under its path. The client then
sends the job's worker token as a bearer token (:func:`gateway_bearer`) and nothing else changes.
"""

from __future__ import annotations

import base64
import http.client
import json
import select
import ssl
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from worker.errors import ElastrainError

DEFAULT_PORT = 2379


class EtcdUnavailableError(ElastrainError):
    """etcd cannot be reached or has no quorum; retry later."""


class EtcdRefusedError(EtcdUnavailableError):
    """An etcd member answered a request with an error (``detail`` is etcd's own text)."""

    def __init__(self, message: str, *, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail


GATEWAY_ENV, TOKEN_ENV = "ELASTRAIN_KV_GATEWAY", "ELASTRAIN_WORKER_TOKEN"
"""Under the service a node is given its job's key-value gateway (a URL with a path, e.g.
``http://svc:8080/v1/jobs/J/kv``) and its worker token, and no etcd endpoint or credential."""


@dataclass(frozen=True, slots=True)
class EtcdEndpoint:
    """One etcd member's client URL, split; or the service's key-value gateway of one job, which
    takes the same requests under ``path`` (``/v3`` for etcd itself)."""

    protocol: str
    host: str
    port: int
    path: str = "/v3"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        tail = "" if self.path == "/v3" else self.path
        return f"{self.protocol}://{host}:{self.port}{tail}"

    @property
    def gateway(self) -> bool:
        """Whether this is the service's gateway (authenticated by a bearer worker token)."""
        return self.path != "/v3"

    @classmethod
    def from_url(cls, url: str) -> EtcdEndpoint:
        """``http(s)://HOST[:PORT]`` (the form ``--etcd`` takes), or a gateway's
        ``http(s)://HOST[:PORT]/PATH``; raises ValueError otherwise."""
        parsed = urlparse(url.strip())
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"etcd endpoint {url!r} is not of the form http://HOST:PORT")
        path = parsed.path.rstrip("/")
        default = 443 if parsed.scheme == "https" and path else 80 if path else DEFAULT_PORT
        return cls(parsed.scheme, parsed.hostname, parsed.port or default, path or "/v3")


def gateway_bearer(endpoints: Sequence[EtcdEndpoint], env: Mapping[str, str]) -> str | None:
    """The worker token to send to a gateway endpoint (None for etcd itself). Raises ValueError
    when an endpoint is a gateway and ``ELASTRAIN_WORKER_TOKEN`` is not set, or when gateways and
    etcd members are mixed."""
    kinds = {e.gateway for e in endpoints}
    if kinds != {True}:
        if True in kinds:
            raise ValueError("give either etcd members or one key-value gateway URL, not both")
        return None
    token = env.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(f"the key-value gateway {endpoints[0].url} needs {TOKEN_ENV} (the service sets it)")
    return token


@dataclass(frozen=True, slots=True)
class Credentials:
    """An etcd user and its password (``repr`` hides the password)."""

    user: str
    password: str = field(repr=False)


TLS_ENV = ("ELASTRAIN_ETCD_CA_CERT", "ELASTRAIN_ETCD_CERT", "ELASTRAIN_ETCD_KEY")
"""The files of :class:`EtcdTLS`, as the service is given them and gives them to every node."""


@dataclass(frozen=True, slots=True)
class EtcdTLS:
    """How to speak TLS to an ``https://`` etcd: ``ca_cert``, a CA bundle that signed etcd's
    certificate (None: the system's CAs), and ``cert``, a client certificate and its key (etcd's
    ``--client-cert-auth``); file paths. Unused for ``http://`` members."""

    ca_cert: str | None = None
    cert: tuple[str, str] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EtcdTLS:
        """From ``ELASTRAIN_ETCD_CA_CERT``, ``ELASTRAIN_ETCD_CERT`` and ``ELASTRAIN_ETCD_KEY``
        (unset or empty: none). Raises ValueError when only one of the certificate and its key
        is given."""
        ca, cert, key = (env.get(name) or None for name in TLS_ENV)
        if (cert is None) != (key is None):
            given, missing = (TLS_ENV[1], TLS_ENV[2]) if cert else (TLS_ENV[2], TLS_ENV[1])
            raise ValueError(f"{given} is set but {missing} is not: give the client certificate and its key")
        return cls(ca, (cert, key) if cert is not None and key is not None else None)

    def env(self) -> dict[str, str]:
        """The variables that :meth:`from_env` reads back (only those set)."""
        values = (self.ca_cert, *(self.cert or (None, None)))
        return {name: value for name, value in zip(TLS_ENV, values, strict=True) if value}

    def context(self) -> ssl.SSLContext:
        """Server verification against ``ca_cert`` and, with ``cert``, the client certificate.
        Raises OSError or ssl.SSLError when a file does not load."""
        context = ssl.create_default_context(cafile=self.ca_cert)
        if self.cert is not None:
            context.load_cert_chain(*self.cert)
        return context

    def check(self) -> None:
        """Load every file as a connection would; raises ValueError naming the variable, the
        file and what is wrong with it (missing, unreadable, not a certificate or key)."""
        parts = [(TLS_ENV[0], self.ca_cert, EtcdTLS(ca_cert=self.ca_cert))] if self.ca_cert else []
        if self.cert is not None:
            parts.append((f"{TLS_ENV[1]}/{TLS_ENV[2]}", ", ".join(self.cert), EtcdTLS(cert=self.cert)))
        for name, files, part in parts:
            try:
                part.context()
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"{name}: {files}: {exc}") from None


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
        tls: EtcdTLS | None = None,
        credentials: Credentials | None = None,
        bearer: str | None = None,
    ) -> None:
        """``tls``: for ``https://`` members (default: the system's CAs, no client certificate).
        ``bearer``: the worker token a gateway endpoint takes (``Authorization: Bearer``)."""
        if not endpoints:
            raise ValueError("give at least one etcd endpoint")
        self.endpoints = tuple(endpoints)
        context = None
        if any(e.protocol == "https" for e in self.endpoints):
            tls = tls or EtcdTLS()
            try:
                context = tls.context()
            except (OSError, ssl.SSLError) as exc:  # a file gone or not what it should be: one line
                files = ", ".join(f for f in (tls.ca_cert, *(tls.cert or ())) if f) or "the system's CAs"
                raise EtcdUnavailableError(f"TLS to etcd: {files} does not load: {exc}") from None
        self._members = [_Member(e, timeout_s, context) for e in self.endpoints]
        self._current = 0
        self.credentials = credentials
        self._bearer = bearer
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
        data = json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        elif self._bearer:
            headers["Authorization"] = f"Bearer {self._bearer}"
        errors: list[str] = []
        start = self._current
        for step in range(len(self._members)):
            index = (start + step) % len(self._members)
            url = self.endpoints[index].url
            try:
                where = f"{self.endpoints[index].path}/{path}"
                status, payload = self._members[index].post(where, data, headers)
            except _NotSent as exc:
                errors.append(f"{url}: connection failed ({exc})")
                continue
            except _Unanswered as exc:
                errors.append(f"{url}: {exc}")
                if not replay_safe:
                    break
                continue
            if status in _UNAVAILABLE:  # the gateway's own answer: no leader, or etcd timed out
                errors.append(f"{url}: HTTP {status} ({_text(payload)})")
                if status == 503 or replay_safe:  # a 503 was not applied
                    continue
                break
            if status != 200:
                detail = _text(payload)
                if path == "auth/authenticate":  # the text names the user; say what to fix instead
                    raise EtcdRefusedError(
                        f"etcd refused the credentials of user {self.credentials.user!r} "  # type: ignore[union-attr]
                        f"({detail}); check the etcd user and password settings",
                        detail=detail,
                    )
                raise EtcdRefusedError(f"etcd refused {path}: {detail}", detail=detail)
            result = _json_object(payload)
            if result is None:  # not etcd's answer (a proxy's page?): it may have been applied
                errors.append(f"{url}: an answer that is not JSON, or not an object ({_text(payload)})")
                if not replay_safe:
                    break
                continue
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
        for member in self._members:
            member.close()


def put_request(key: str, value: bytes, *, lease: int = 0) -> dict[str, Any]:
    """The body of a put (also a txn's ``request_put``)."""
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def is_lease_not_found(exc: EtcdRefusedError) -> bool:
    return "lease not found" in exc.detail


# The grpc-gateway's answers that say the member could not serve the request: 503 (no leader,
# not applied), 408 and 504 (etcd's own timeout: it may have been applied).
_UNAVAILABLE = frozenset({408, 503, 504})


class _NotSent(Exception):
    """The request never reached the member (no connection): safe to send elsewhere."""


class _Unanswered(Exception):
    """The request was sent, or may have been, and no answer came: it may have been applied."""


def _json_object(payload: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(payload)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _text(payload: bytes) -> str:
    return payload.decode("utf-8", "replace").strip()[:200]


class _Member:
    """One etcd member: a pool of keep-alive connections, taken by one request at a time (a
    thread that ends leaves nothing behind; a new thread finds an idle connection, as it did in
    requests' pool)."""

    MAX_IDLE = 64  # as many as the API's thread pool may hold at once

    def __init__(self, endpoint: EtcdEndpoint, timeout_s: float, tls: ssl.SSLContext | None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._tls = tls
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _connect(self) -> http.client.HTTPConnection:
        e = self.endpoint
        conn: http.client.HTTPConnection
        if e.protocol == "https":
            conn = http.client.HTTPSConnection(e.host, e.port, timeout=self.timeout_s, context=self._tls)
        else:
            conn = http.client.HTTPConnection(e.host, e.port, timeout=self.timeout_s)
        try:
            conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _NotSent(_reason(exc)) from None
        return conn  # http.client sets TCP_NODELAY itself

    def _take(self) -> http.client.HTTPConnection:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect()
            if not _dropped(conn):
                return conn
            conn.close()

    def post(self, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        conn = self._take()
        try:
            conn.request("POST", path, body=data, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        except TimeoutError:
            conn.close()
            raise _Unanswered(f"timed out after {self.timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise _Unanswered(f"connection lost ({_reason(exc)})") from None
        kept = False
        if not response.will_close:
            with self._lock:
                if len(self._idle) < self.MAX_IDLE:
                    self._idle.append(conn)
                    kept = True
        if not kept:
            conn.close()
        return response.status, payload

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle connection was closed by the member (readable while idle: its end, or
    bytes nobody asked for), so that a request is never sent on it."""
    if conn.sock is None:
        return True
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
