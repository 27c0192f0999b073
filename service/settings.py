"""Service settings: environment variables ``ELASTRAIN_*`` (the Helm chart sets these names),
overridden by ``elastrain serve`` flags. Nonsense is refused with a message saying what to fix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlparse

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.errors import ElastrainError
from worker.etcdclient import TLS_ENV, EtcdTLS


class SettingsError(ElastrainError):
    """A setting that cannot work; the message names the variable and the fix."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ELASTRAIN_", extra="ignore", frozen=True)

    host: str = "127.0.0.1"
    """Address uvicorn binds."""
    port: int = Field(default=8080, ge=0, le=65535)
    worker_port: int | None = Field(default=None, ge=1, le=65535)
    """A second port, for the workers' calls (heartbeats, progress, events, checkpoint reports,
    the key-value gateway), served on an event loop of its own so that a user's request never
    waits behind a burst of them; the nodes launched are told this port. Unset: workers call
    ``port`` like everyone else. The same routes and tokens are served on both."""
    data_dir: Path = Path(".elastrain")
    """Embedded etcd data, the generated API token."""
    etcd: str = ""
    """Comma-separated etcd endpoints (http://HOST:PORT); empty starts an embedded etcd."""
    etcd_user: str = Field(default="root", min_length=1, max_length=128)
    """The etcd user the service acts as: root, or a user with the root role (the only etcd user
    it needs; jobs hold no etcd credential)."""
    etcd_password: SecretStr | None = None
    """Its password. The embedded etcd: generated at first start into
    ``<data dir>/etcd-root-password``. Unset with ELASTRAIN_ETCD: an etcd without auth, where every
    job's code can read and write all of etcd."""
    etcd_ca_cert: str = ""
    """A CA bundle that signed the ``https://`` etcd's certificate (empty: the system's CAs)."""
    etcd_cert: str = ""
    etcd_key: str = ""
    """A client certificate and its key, for an etcd with ``--client-cert-auth``. These three are
    file paths the service reads; no node it launches is given them (jobs reach etcd only
    through the service's key-value gateway)."""
    storage_root: Path | None = None
    """Where checkpoints live; default <data_dir>/checkpoints. Every job's dir resolves inside it."""
    api_token: SecretStr | None = None
    token_file: Path | None = None
    scheduler: Literal["local_cwd", "kubernetes"] = "local_cwd"
    k8s_namespace: str = "default"
    k8s_queue: str = ""
    worker_image: str = ""
    k8s_service_account: str = ""
    checkpoint_claim: str = ""
    checkpoint_mount: str = "/checkpoints"
    storage_secret: str = ""
    """kubernetes: the Secret holding the object storage credentials (``AWS_ACCESS_KEY_ID``,
    ``AWS_SECRET_ACCESS_KEY``, optionally ``AWS_SESSION_TOKEN``) that the worker pods of a job on
    ``s3://`` get through ``secretKeyRef``. The service's own credentials are the standard
    ``AWS_*`` variables of its environment (the chart sets both from the same Secret)."""
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)
    http_header_timeout_s: float = Field(default=10.0, gt=0, le=600)
    """How long a client may take to send a request's line and headers, from its connection (or
    its request's first byte); then the connection is answered 408 and closed."""
    http_body_timeout_s: float = Field(default=30.0, gt=0, le=3600)
    """How long a client may take to send a request's body once its headers are in; then the
    request is answered 408 (if it has no answer yet) and the connection closed."""
    http_max_connections: int = Field(default=4096, ge=16, le=1 << 20)
    """The most client connections open at once (at most three quarters of the file limit, so
    that etcd, checkpoint files and launches keep theirs); one over it is answered 503 and closed."""
    advertise_url: str = ""
    """URL workers use to reach this service; default http://HOST:WORKER_PORT, else
    http://HOST:PORT (loopback for 0.0.0.0)."""
    instance_url: str = ""
    """URL the other service instances use to reach this one (a standby forwards writes to the
    leader there); default: the advertise URL, or http://HOST:PORT when a worker port is set (the
    advertise URL then names the workers' port). On Kubernetes the chart sets the pod's IP."""
    factory_allowlist: str | None = None
    """Comma-separated module prefixes the factories of a spec (model, data, loss) may come from:
    ``team_a`` allows ``team_a:f`` and ``team_a.models:f``. Unset: any module (whoever holds the
    API token runs code on the workers anyway); empty: the built-in models and data only."""
    reconcile_interval_s: float = Field(default=1.0, gt=0, le=60)
    reconcile_idle_interval_s: float = Field(default=5.0, gt=0, le=300)
    """Between passes while every job runs steadily (a job write wakes the reconciler at once)."""
    leader_ttl_s: int = Field(default=10, ge=2, le=300)
    heartbeat_timeout_s: float = Field(default=60.0, gt=0)
    local_slots: int | None = Field(default=None, ge=1, le=65536)
    """local_cwd: how many worker processes the local scheduler runs at once (a job of N nodes x
    P processes, and each warm spare's P, take N x P slots); a job that does not fit waits in
    QUEUED. Default: the host's GPUs when it has any, else its CPU cores."""
    startup_timeout_s: float = Field(default=300.0, gt=0)
    kv_job_bytes: int = Field(default=4 << 20, ge=64 << 10, le=256 << 20)
    """The key-value gateway: bytes one job may keep under its rendezvous prefix (keys plus
    values). Its rendezvous and peer group keep a few KiB; a write past this is refused (413)."""
    kv_job_keys: int = Field(default=1024, ge=64, le=100_000)
    """Keys one job may keep under its prefix."""
    kv_request_bytes: int = Field(default=256 << 10, ge=16 << 10, le=1 << 20)
    """Bytes one gateway request may write (a put's key and value; every put of a txn)."""
    kv_job_leases: int = Field(default=64, ge=4, le=10_000)
    """Leases one job may hold at once (each torchrun agent and worker holds one or two)."""
    kv_lease_ttl_s: int = Field(default=3600, ge=60, le=86_400)
    """The longest TTL a job's lease may be granted."""
    kv_total_bytes: int = Field(default=256 << 20, ge=1 << 20, le=256 << 20)
    """Bytes all jobs together may keep through the gateway: at most an eighth of etcd's default
    2 GiB quota (``--quota-backend-bytes``), so that jobs can never raise its NOSPACE alarm."""
    kv_write_bytes_per_s: int = Field(default=2 << 20, ge=64 << 10, le=2 << 20)
    """Bytes all jobs together may write through the gateway per second (a burst of 30 s of
    it). etcd keeps overwritten values until it compacts (every 5 minutes), so this bounds what
    jobs add between compactions: 2 MiB/s is 600 MiB, which with ``kv_total_bytes`` stays under
    half of etcd's default quota."""

    @field_validator("etcd")
    @classmethod
    def _etcd_urls(cls, value: str) -> str:
        for url in (u.strip() for u in value.split(",") if u.strip()):
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"etcd endpoint {url!r} must look like http://HOST:PORT")
        return value

    @field_validator("factory_allowlist")
    @classmethod
    def _module_prefixes(cls, value: str | None) -> str | None:
        for prefix in _prefixes(value):
            if not _MODULE_RE.match(prefix):
                raise ValueError(
                    f"{prefix!r} is not a module name; give dotted Python module names, e.g. "
                    "'team_a,team_b.models'"
                )
        return value

    @property
    def factory_prefixes(self) -> tuple[str, ...] | None:
        """The allowed module prefixes; None: any module."""
        return None if self.factory_allowlist is None else _prefixes(self.factory_allowlist)

    @field_validator("advertise_url", "instance_url")
    @classmethod
    def _advertise(cls, value: str) -> str:
        if value and urlparse(value).scheme not in ("http", "https"):
            raise ValueError(f"{value!r} must be an http:// or https:// URL")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.api_token is not None and len(self.api_token.get_secret_value()) < 16:
            raise ValueError(
                "api_token must be at least 16 characters (generate one with `openssl rand -hex 32`)"
            )
        if self.api_token is not None and self.token_file is not None:
            raise ValueError("give ELASTRAIN_API_TOKEN or a token file, not both")
        if self.scheduler == "kubernetes":
            if not self.worker_image:
                raise ValueError("scheduler 'kubernetes' needs ELASTRAIN_WORKER_IMAGE (the worker image)")
            if not self.etcd:
                raise ValueError(
                    "scheduler 'kubernetes' needs ELASTRAIN_ETCD: pods cannot reach the embedded etcd"
                )
        if self.worker_port is not None and self.worker_port == self.port:
            raise ValueError(
                f"ELASTRAIN_WORKER_PORT {self.worker_port} is also ELASTRAIN_PORT: give the workers "
                "another port, or leave ELASTRAIN_WORKER_PORT unset to serve them on the API's port"
            )
        if not self.checkpoint_mount.startswith("/"):
            raise ValueError(f"checkpoint_mount {self.checkpoint_mount!r} must be an absolute path")
        tls = self.etcd_tls  # raises when only one of the certificate and its key is given
        if tls != EtcdTLS():
            if self.embedded_etcd:
                raise ValueError(
                    f"{', '.join(tls.env())} set without ELASTRAIN_ETCD: the embedded etcd speaks plain "
                    "http; give the https:// endpoints of the etcd those files are for"
                )
            if not any(u.startswith("https://") for u in self.etcd_endpoints):
                raise ValueError(
                    f"{', '.join(tls.env())} set but ELASTRAIN_ETCD has no https:// endpoint: "
                    "give etcd's https:// client URLs, or unset them"
                )
            tls.check()
        return self

    @property
    def etcd_tls(self) -> EtcdTLS:
        """The TLS files for etcd, as absolute paths (the nodes run in other directories)."""
        absolute = {
            name: str(Path(value).absolute())
            for name, value in zip(TLS_ENV, (self.etcd_ca_cert, self.etcd_cert, self.etcd_key), strict=True)
            if value
        }
        return EtcdTLS.from_env(absolute)

    @property
    def embedded_etcd(self) -> bool:
        return not self.etcd.strip()

    @property
    def etcd_endpoints(self) -> list[str]:
        return [u.strip() for u in self.etcd.split(",") if u.strip()]

    @property
    def checkpoint_root(self) -> Path:
        return (self.storage_root or self.data_dir / "checkpoints").absolute()

    @property
    def instance_address(self) -> str:
        if self.instance_url:
            return self.instance_url
        return self.service_url if self.worker_port is None else self._loopback_url(self.port)

    @property
    def instance_workers_address(self) -> str | None:
        """Where the other instances reach this one's workers' listener: the instance address's
        host at the workers' port; None without a worker port. A standby passes the workers'
        calls it receives there, so they stay off the leader's users' port."""
        if self.worker_port is None:
            return None
        host = urlparse(self.instance_address).hostname or "127.0.0.1"
        return _url(host, self.worker_port)

    @property
    def listen_url(self) -> str:
        """The address uvicorn binds, as a URL (``http://0.0.0.0:8080`` binds every interface)."""
        return _url(self.host, self.port)

    @property
    def service_url(self) -> str:
        """The URL the nodes launched are given: the advertise URL, else this host's workers'
        port (the API's when no worker port is set)."""
        if self.advertise_url:
            return self.advertise_url
        return self._loopback_url(self.worker_port or self.port)

    @property
    def worker_listen_url(self) -> str | None:
        """The address the workers' listener binds, as a URL; None without a worker port."""
        return None if self.worker_port is None else _url(self.host, self.worker_port)

    def _loopback_url(self, port: int) -> str:
        """This host at ``port``, as others on it reach it (loopback for a wildcard address)."""
        return _url("127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host, port)


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


_MODULE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _prefixes(value: str | None) -> tuple[str, ...]:
    return tuple(p.strip() for p in (value or "").split(",") if p.strip())


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment plus explicit overrides (None values are ignored).
    Raises :class:`SettingsError` naming every problem."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)  # type: ignore[arg-type]
    except ValidationError as exc:
        problems = []
        for item in exc.errors():
            name = "_".join(str(p) for p in item["loc"]).upper()
            where = f"ELASTRAIN_{name}: " if name else ""
            problems.append(where + item["msg"].removeprefix("Value error, "))
        raise SettingsError("; ".join(problems)) from None
