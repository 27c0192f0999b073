"""torchrun's ``etcd-v3`` rendezvous: torch's dynamic rendezvous with its state and store in etcd v3.

Use: ``torchrun --nnodes MIN:MAX --rdzv-backend etcd-v3 --rdzv-endpoint H1:2379[,H2:2379...]
--rdzv-id JOB [--rdzv-conf key=value,...] ...``. The backend is found through the
``torchrun.handlers`` entry-point group (``etcd-v3 = "service.rendezvous:create_handler"``, which
imports this module when torchrun calls it). This module runs inside torchrun agents and imports
torch; the service never imports it.

Design
------
* **State**: :class:`EtcdV3RendezvousBackend` keeps torch's pickled rendezvous state in one key,
  ``<key_prefix>/<run id>/state``. The fencing token is the key's ``mod_revision``; ``set_state``
  is one etcd transaction comparing it (or ``create_revision == 0`` for the first write), so
  two nodes can never both win a round. torch's own etcd backends speak etcd's v2 API
  (python-etcd), which etcd 3.6 removed.
* **Store**: the c10d store torch's handler hands to the agents is :class:`EtcdV3Store`, also in
  etcd, rather than a TCPStore hosted by the rank-0 agent (what the c10d backend does). Any
  node may die at any time and the survivors still reach the store and re-form; with an
  agent-hosted store, losing that agent loses the store and every later round on it. The
  store carries only a few keys per round (master address/port, worker ranks, exit barrier),
  so etcd's latency costs milliseconds per round. etcd itself is the only shared dependency,
  and it is a quorum (give several ``--rdzv-endpoint`` members; the client fails over).
* **Workers' store**: the handler forces ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: worker rank 0
  hosts a fresh TCPStore on a fresh port for each attempt. Sharing one agent-hosted TCPStore
  across attempts is what loses torchrun's first restart (pytorch/pytorch#135712: the new
  gloo group reads the previous attempt's keys and fails ``connectFullMesh``).
* **Under the service**: the endpoint is the service's key-value gateway of the job
  (``--rdzv-endpoint http://svc:8080/v1/jobs/J/kv``), authenticated by the job's worker token
  (``ELASTRAIN_WORKER_TOKEN``); the job holds no etcd endpoint or credential, and its keys are
  confined to ``<key_prefix>/<run id>/`` (:mod:`service.etcd.gateway_rules`). With a user's own
  etcd (``--rdzv-endpoint host:port``) the handler talks to it directly, without auth.
* **Expiry**: every key is written under the writing agent's etcd lease (``state_ttl``), so
  a run's keys vanish ``state_ttl`` seconds after its last agent stopped; the service may
  delete ``<key_prefix>/<run id>`` at once when a job ends.
* **Timeouts**: see :class:`service.rendezvous.config.RendezvousConfig` for the chosen values
  (a 3 s last call instead of torch's 30 s; a dead node is dropped after ~6 s).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousTimeout,
)

from service.rendezvous.config import RendezvousConfig, RendezvousConfigError, parse_config, parse_endpoints
from service.rendezvous.kv import EtcdKV
from service.rendezvous.store import EtcdV3Store
from worker.etcdclient import EtcdRefusedError, EtcdTLS, EtcdUnavailableError, gateway_bearer

log = logging.getLogger(__name__)
T = TypeVar("T")
P = ParamSpec("P")

BACKEND_NAME = "etcd-v3"
DISABLE_SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class EtcdV3RendezvousBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on one etcd key; the token is its ``mod_revision`` (int)."""

    def __init__(self, kv: EtcdKV, key: str) -> None:
        self._kv = kv
        self._key = key

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> tuple[bytes, Any] | None:
        """The state and its token, or ``None`` when no node has written one yet."""
        found = self._io(self._kv.get, self._key)
        return None if found is None else (found.value, found.mod_revision)

    def set_state(self, state: bytes, token: Any | None = None) -> tuple[bytes, Any, bool] | None:
        """Write ``state`` iff the stored token is still ``token`` (iff no state when ``None``).

        Returns (state now stored, its token, whether ours was written), or ``None`` when the
        key vanished between our compare and our read (expired; the caller starts over)."""
        if token is not None and not isinstance(token, int):
            current = self.get_state()
            return None if current is None else (*current, False)
        written, now = self._io(self._kv.cas, self._key, state, token)
        if now is None:
            return None
        return now.value, now.mod_revision, written

    @staticmethod
    def _io(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return call(*args, **kwargs)
        except EtcdRefusedError as exc:
            raise RendezvousStateError(f"etcd refused a rendezvous operation: {exc.detail}") from exc
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc


def create_backend(params: RendezvousParameters) -> tuple[EtcdV3RendezvousBackend, Store, RendezvousConfig]:
    """The backend, the store and the parsed settings for ``params`` (torchrun's arguments)."""
    config = parse_config(dict(params.config))
    endpoints = parse_endpoints(params.endpoint, default_protocol=config.protocol)
    cert = (config.cert_file, config.key_file) if config.cert_file and config.key_file else None
    try:  # what the environment gives, where --rdzv-conf says nothing
        given = EtcdTLS.from_env(os.environ)
        bearer = gateway_bearer(endpoints, os.environ)
    except ValueError as exc:
        raise RendezvousConfigError(str(exc)) from None
    kv = EtcdKV(
        endpoints,
        lease_ttl=config.state_ttl,
        read_timeout=config.read_timeout,
        tls=EtcdTLS(config.ca_cert or given.ca_cert, cert or given.cert),
        bearer=bearer,
    )
    backend = EtcdV3RendezvousBackend(kv, config.state_key(params.run_id))
    store = EtcdV3Store(kv, config.store_prefix(params.run_id))
    return backend, store, config


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the etcd-v3 handler for ``params``: what torch's handler registry calls."""
    if os.environ.get(DISABLE_SHARED_STORE_ENV) != "1":
        # Must hold before the handler's first next_rendezvous(); see the module docstring.
        log.info(
            "etcd-v3 rendezvous: setting %s=1 (workers get a fresh store per attempt)",
            DISABLE_SHARED_STORE_ENV,
        )
        os.environ[DISABLE_SHARED_STORE_ENV] = "1"
    backend, store, config = create_backend(params)
    timeout = RendezvousTimeout(
        join=timedelta(seconds=config.join_timeout),
        last_call=timedelta(seconds=config.last_call_timeout),
        close=timedelta(seconds=config.close_timeout),
        heartbeat=timedelta(seconds=config.heartbeat_timeout),
    )
    return DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        timeout,
        keep_alive_interval=config.keep_alive_interval,  # type: ignore[arg-type]  # a float works
        keep_alive_max_attempt=config.keep_alive_max_attempt,
    )


def register() -> None:
    """Register ``etcd-v3`` in this process's handler registry (for launchers that bypass entry
    points). torch checks that the handler's backend name equals the registered name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND_NAME, create_rdzv_handler)
