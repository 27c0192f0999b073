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
    data_dir: Path = Path(".elastrain")
    """Embedded etcd data, the generated API token."""
    etcd: str = ""
    """Comma-separated etcd endpoints (http://HOST:PORT); empty starts an embedded etcd."""
    etcd_user: str = Field(default="root", min_length=1, max_length=128)
    """The etcd user the service acts as: root, or a user with the root role (it creates each
    job's own user)."""
    etcd_password: SecretStr | None = None
    """Its password. The embedded etcd: generated at first start into
    ``<data dir>/etcd-root-password``. Unset with ELASTRAIN_ETCD: an etcd without auth, where every
    job's code can read and write all of etcd."""
    etcd_ca_cert: str = ""
    """A CA bundle that signed the ``https://`` etcd's certificate (empty: the system's CAs)."""
    etcd_cert: str = ""
    etcd_key: str = ""
    """A client certificate and its key, for an etcd with ``--client-cert-auth``. These three are
    file paths; every node the service launches is given them (the files must be there too)."""
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
    k8s_etcd_tls_secret: str = ""
    """kubernetes: a Secret holding the etcd TLS files (ELASTRAIN_ETCD_CA_CERT...), mounted
    read-only into every worker pod at the directory they are in here, so that the nodes find them
    at the paths they are given (the chart mounts the same Secret there in the service's pod).
    All of them must be in one directory, under their names as the Secret's keys."""
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
    """URL workers use to reach this service; default http://HOST:PORT (loopback for 0.0.0.0)."""
    instance_url: str = ""
    """URL the other service instances use to reach this one (a standby forwards writes to the
    leader there); default: the advertise URL. On Kubernetes the chart sets the pod's IP."""
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
        if self.k8s_etcd_tls_secret:
            if self.etcd_tls_dir in (self.checkpoint_mount.rstrip("/"), "/tmp"):
                raise ValueError(
                    f"the etcd TLS files are in {self.etcd_tls_dir}, where a worker pod mounts its "
                    "checkpoints or its /tmp: put them in a directory of their own for "
                    "ELASTRAIN_K8S_ETCD_TLS_SECRET to be mounted at"
                )
            if self.scheduler != "kubernetes":
                raise ValueError(
                    "ELASTRAIN_K8S_ETCD_TLS_SECRET is for scheduler 'kubernetes' (it mounts the Secret "
                    "into worker pods); unset it, or set ELASTRAIN_SCHEDULER=kubernetes"
                )
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
    def etcd_tls_dir(self) -> str:
        """The one directory the etcd TLS files are in (where ELASTRAIN_K8S_ETCD_TLS_SECRET goes
        in a worker pod). Raises ValueError without TLS files, or with them in several."""
        files = list(self.etcd_tls.env().values())
        folders = sorted({str(Path(f).parent) for f in files})
        if len(folders) != 1:
            given = ", ".join(self.etcd_tls.env()) or "none of " + ", ".join(TLS_ENV)
            raise ValueError(
                "ELASTRAIN_K8S_ETCD_TLS_SECRET needs the etcd TLS files in one directory, where the "
                f"Secret is mounted (given: {given}"
                + (f", in {', '.join(folders)}" if folders else "")
                + "); set ELASTRAIN_ETCD_CA_CERT (and a client certificate) to files in the Secret's "
                "mount, or unset ELASTRAIN_K8S_ETCD_TLS_SECRET"
            )
        return folders[0]

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
        return self.instance_url or self.service_url

    @property
    def listen_url(self) -> str:
        """The address uvicorn binds, as a URL (``http://0.0.0.0:8080`` binds every interface)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def service_url(self) -> str:
        if self.advertise_url:
            return self.advertise_url
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"


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
