"""The etcd-v3 rendezvous's settings: pure parsing of torchrun's ``--rdzv-endpoint``/``--rdzv-conf``.

Torch-free so the service, the scheduler and unit tests can use it. The defaults are chosen for
fast recovery of small elastic jobs (see :class:`RendezvousConfig`), and the scheduler passes
exactly these values on every torchrun command line it builds (:func:`rdzv_conf_arg`), so a
node launched by the service and a hand-typed ``torchrun --rdzv-backend etcd-v3`` behave alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from service.etcd.access import RENDEZVOUS_ROOT
from worker.errors import ElastrainError
from worker.etcdclient import DEFAULT_PORT, EtcdEndpoint

DEFAULT_KEY_PREFIX = RENDEZVOUS_ROOT


class RendezvousConfigError(ElastrainError, ValueError):
    """A ``--rdzv-endpoint`` or ``--rdzv-conf`` value the etcd-v3 rendezvous cannot use."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousConfig:
    """Timeouts and etcd options of one rendezvous; every field is a ``--rdzv-conf`` key.

    Why these defaults (torch's are join 600 s, last_call 30 s, close 30 s, heartbeat 5 s,
    keep-alive every 5 s, 3 misses):

    * ``last_call_timeout`` 3 s: once ``min`` nodes are in, the round waits this long for more
      before it completes (a round with ``max`` nodes completes at once). torch's 30 s is added
      to every re-rendezvous of a job running below its max. 3 s covers torch's 1 s polling
      period twice over, so a node that restarts a moment later still makes the round instead
      of forcing a second restart.
    * ``keep_alive_interval`` 2 s × ``keep_alive_max_attempt`` 3: a node whose agent died
      (machine lost) is dropped from the rendezvous after ~6 s instead of ~15 s; a GC pause or
      a busy CPU shorter than that does not evict a live node.
    * ``join_timeout`` 600 s (torch's): on a cluster, pods may wait minutes to be scheduled.
    * ``close_timeout`` 10 s, ``heartbeat_timeout`` 5 s: how long one close or keep-alive
      write may take before it counts as failed.
    * ``state_ttl`` 600 s: the rendezvous keys expire this long after the last live node
      wrote them (every keep-alive rewrites them), so a finished run's closed rendezvous does
      not block a later run that reuses its id for longer than that.
    * ``read_timeout`` 5 s: one HTTP request to an etcd member; then the next member is tried.
    * ``protocol`` is the scheme for endpoints given without one; ``ca_cert``, ``cert_file``
      and ``key_file`` set up TLS to etcd.
    """

    join_timeout: float = 600.0
    last_call_timeout: float = 3.0
    close_timeout: float = 10.0
    heartbeat_timeout: float = 5.0
    keep_alive_interval: float = 2.0
    keep_alive_max_attempt: int = 3
    state_ttl: int = 600
    read_timeout: float = 5.0
    key_prefix: str = DEFAULT_KEY_PREFIX
    protocol: str = "http"
    ca_cert: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout"):
            _require_positive(name, getattr(self, name))
        _require_positive("keep_alive_interval", self.keep_alive_interval)
        _require_positive("read_timeout", self.read_timeout)
        if self.keep_alive_max_attempt < 1:
            raise RendezvousConfigError(
                f"keep_alive_max_attempt={self.keep_alive_max_attempt}: give at least 1"
            )
        if self.state_ttl < 5 * self.keep_alive_interval:
            raise RendezvousConfigError(
                f"state_ttl={self.state_ttl}s must be at least 5 keep-alive intervals "
                f"({5 * self.keep_alive_interval:g}s), or live rendezvous keys could expire"
            )
        if not self.key_prefix.startswith("/") or self.key_prefix.endswith("/"):
            raise RendezvousConfigError(
                f"key_prefix={self.key_prefix!r}: give an absolute key like '/elastrain/rdzv' "
                "without a trailing '/'"
            )
        if self.protocol not in ("http", "https"):
            raise RendezvousConfigError(f"protocol={self.protocol!r}: give http or https")
        if (self.cert_file is None) != (self.key_file is None):
            raise RendezvousConfigError("give both cert_file and key_file for a client certificate")

    def state_key(self, run_id: str) -> str:
        """The etcd key holding torch's pickled rendezvous state of ``run_id``."""
        return f"{self.run_prefix(run_id)}/state"

    def store_prefix(self, run_id: str) -> str:
        """The etcd key prefix under which the c10d store of ``run_id`` keeps its keys."""
        return f"{self.run_prefix(run_id)}/store/"

    def run_prefix(self, run_id: str) -> str:
        """Every key of ``run_id`` lives under this prefix (delete it to forget the run)."""
        if not run_id or "/" in run_id:
            raise RendezvousConfigError(f"rendezvous id {run_id!r}: give a non-empty id without '/'")
        return f"{self.key_prefix}/{run_id}"


_FLOAT_KEYS = {"join_timeout", "last_call_timeout", "close_timeout", "heartbeat_timeout"}
_FLOAT_KEYS |= {"keep_alive_interval", "read_timeout"}
_INT_KEYS = {"keep_alive_max_attempt", "state_ttl"}
_STR_KEYS = {"key_prefix", "protocol", "ca_cert", "cert_file", "key_file"}
# Keys torchrun itself or other backends put into the config; accepted and ignored.
_IGNORED_KEYS = {"timeout", "rank", "is_host", "store_type"}
KNOWN_KEYS = frozenset(_FLOAT_KEYS | _INT_KEYS | _STR_KEYS)


def _require_positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise RendezvousConfigError(f"{name}={value}: give a positive number of seconds")


def parse_config(raw: dict[str, Any]) -> RendezvousConfig:
    """Build a :class:`RendezvousConfig` from ``RendezvousParameters.config`` (strings or values).

    Unknown keys are refused with the list of known ones, so a typo is not silently ignored.
    """
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None or key in _IGNORED_KEYS:
            continue
        try:
            if key in _FLOAT_KEYS:
                values[key] = float(value)
            elif key in _INT_KEYS:
                values[key] = int(value)
            elif key in _STR_KEYS:
                values[key] = str(value)
            else:
                known = ", ".join(sorted(KNOWN_KEYS))
                raise RendezvousConfigError(f"unknown --rdzv-conf key {key!r}; known keys: {known}")
        except (TypeError, ValueError) as exc:
            if isinstance(exc, RendezvousConfigError):
                raise
            raise RendezvousConfigError(f"--rdzv-conf {key}={value!r} is not a number") from None
    return RendezvousConfig(**values)


def parse_endpoints(endpoint: str, *, default_protocol: str = "http") -> tuple[EtcdEndpoint, ...]:
    """``"h1:2379,http://h2:2379,[::1]"`` -> the members to try, in order.

    An endpoint may carry ``http://`` or ``https://``; a missing port means 2379. A URL with a
    path (``http://svc:8080/v1/jobs/J/kv``) is the service's key-value gateway of job J.
    """
    members = [part.strip() for part in endpoint.split(",") if part.strip()]
    if not members:
        raise RendezvousConfigError(
            "the etcd-v3 rendezvous needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] (etcd client URLs)"
        )
    return tuple(_parse_one(member, default_protocol) for member in members)


def _parse_one(member: str, default_protocol: str) -> EtcdEndpoint:
    protocol = default_protocol
    rest = member
    if "://" in member:
        protocol, rest = member.split("://", 1)
        if "/" in rest.rstrip("/"):  # the gateway: a URL with a path
            try:
                return EtcdEndpoint.from_url(member)
            except ValueError:
                message = f"etcd endpoint {member!r}: give [http(s)://]HOST[:PORT][/PATH]"
                raise RendezvousConfigError(message) from None
    rest = rest.rstrip("/")
    if protocol not in ("http", "https") or not rest or "/" in rest:
        raise RendezvousConfigError(f"etcd endpoint {member!r}: give [http(s)://]HOST[:PORT]")
    host, port_text = rest, ""
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        port_text = tail.removeprefix(":")
    elif rest.count(":") == 1:
        host, port_text = rest.split(":")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise RendezvousConfigError(f"etcd endpoint {member!r}: the port is not a number") from None
    if not host or not 0 < port < 65536:
        raise RendezvousConfigError(f"etcd endpoint {member!r}: give [http(s)://]HOST[:PORT]")
    return EtcdEndpoint(protocol=protocol, host=host, port=port)


def rdzv_conf_arg(config: RendezvousConfig | None = None) -> str:
    """The ``--rdzv-conf`` value that reproduces ``config`` (the defaults if ``None``)."""
    config = config or RendezvousConfig()
    parts = []
    for field in fields(config):
        value = getattr(config, field.name)
        if value is not None:
            parts.append(f"{field.name}={value:g}" if isinstance(value, float) else f"{field.name}={value}")
    return ",".join(parts)
