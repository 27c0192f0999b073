"""``elastrain serve``: etcd (embedded or given), the API under uvicorn, the reconciler.

The embedded etcd is a process under ``<data-dir>/etcd`` that a graceful stop stops; after a
``kill -9`` of the service it keeps running and the next start adopts it.
The API token comes from ``ELASTRAIN_API_TOKEN``, else ``--token-file``, else
``<data-dir>/api-token`` (generated at first start, mode 0600; its path is logged, never the
token). A graceful stop (SIGINT/SIGTERM) stops the reconciler, resigns leadership, closes the
scheduler (TorchX's local scheduler then stops the local nodes it started) and stops etcd; a
``kill -9`` leaves local nodes running, and the next start adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import FrameType
from typing import Literal

import uvicorn
from fastapi import FastAPI

from service.api.app import create_app
from service.api.connections import ConnectionLimits, connection_cap, guarded_protocol, raise_file_limit
from service.api.forward import LeaderLookup
from service.checkpoints.service import Checkpoints
from service.etcd.access import ROOT_USER, EtcdAuth
from service.etcd.election import LeaderElection, leader_address
from service.etcd.gateway import KvGateway
from service.etcd.gateway_budget import KvBudget
from service.etcd.kv import EtcdStore, Fence
from service.etcd.server import EtcdServer, defragment_if_sparse
from service.jobs.machine import Policy
from service.jobs.objectstore import ObjectStorage
from service.jobs.parts import JobParts
from service.jobs.service import ensure_worker_secret
from service.launch.environment import launch_storage_env
from service.launch.protocol import Scheduler
from service.launch.threads import host_slots
from service.metrics import InstrumentedStore, Metrics
from service.reconciler import LaunchContext, Reconciler
from service.settings import Settings, SettingsError
from worker.etcdclient import Credentials, EtcdClient, EtcdEndpoint, EtcdUnavailableError

log = logging.getLogger("elastrain.server")
TOKEN_FILE_NAME = "api-token"
ROOT_PASSWORD_FILE = "etcd-root-password"
WRITE_BEHIND_S = 0.5
"""How long heartbeats and progress reports gather before they go to etcd in one transaction."""


def resolve_api_token(settings: Settings) -> tuple[str, str]:
    """(token, where it came from). Generates ``<data-dir>/api-token`` (0600) when none is set."""
    if settings.api_token is not None:
        return settings.api_token.get_secret_value(), "ELASTRAIN_API_TOKEN"
    path = settings.token_file or settings.data_dir / TOKEN_FILE_NAME
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        if settings.token_file is not None:
            raise SettingsError(
                f"token file {str(path)!r} does not exist; create it or leave --token-file out"
            ) from None
        token = ""
    except OSError as exc:
        raise SettingsError(f"cannot read token file {str(path)!r}: {exc.strerror}") from None
    if token:
        if len(token) < 16:
            raise SettingsError(f"the token in {str(path)!r} is shorter than 16 characters; use a longer one")
        return token, str(path)
    token = secrets.token_urlsafe(32)
    _write_secret(path, token)
    return token, f"{path} (generated)"


def holder_id(settings: Settings) -> str:
    """A stable leader id per host and data dir: a restarted service takes over at once."""
    where = f"{settings.data_dir.absolute()}:{settings.port}"
    return f"{socket.gethostname()}-{hashlib.sha1(where.encode()).hexdigest()[:8]}"


def leader_fence(election: LeaderElection, *, wait_s: float) -> Fence | None:
    """This instance's fence; while it has none, wait up to ``wait_s`` for the reconciler's
    campaign (a restarted service takes its own stale leader key over within one pass)."""
    deadline = time.monotonic() + wait_s
    while election.fence is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return election.fence


def build_scheduler(settings: Settings, endpoints: list[str]) -> Scheduler:
    from service.launch.apps import SchedulerSettings
    from service.launch.hostgpus import host_gpus
    from service.launch.threads import host_cores, host_slots
    from service.launch.torchx_scheduler import TorchXScheduler

    host: dict[str, int] = {}
    if settings.scheduler == "local_cwd":  # what this machine gives the nodes it runs
        host = {
            "host_gpus": host_gpus(),
            "host_cores": host_cores(),
            "local_slots": host_slots(settings.local_slots),
        }
    config = SchedulerSettings.from_settings(
        settings,
        rdzv_endpoint=",".join(endpoints),
        log_root=str((settings.data_dir / "nodes").absolute()),
        **host,
    )
    return TorchXScheduler(config)


def wait_for_store(store: EtcdStore, endpoints: list[str], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not store.healthy():
        if time.monotonic() > deadline:
            raise EtcdUnavailableError(
                f"etcd at {','.join(endpoints)} did not answer within {timeout_s:.0f}s; "
                "check --etcd / ELASTRAIN_ETCD"
            )
        time.sleep(0.5)


@contextlib.contextmanager
def etcd_for(settings: Settings) -> Iterator[tuple[list[str], Credentials | None]]:
    """The etcd endpoints to use and the service's credentials there (None: etcd without auth);
    starts (and finally stops) the embedded one if none is given, with auth on."""
    if not settings.embedded_etcd:
        yield settings.etcd_endpoints, external_credentials(settings)
        return
    # It outlives a crashed service (running nodes keep their rendezvous); the next start adopts it.
    server = EtcdServer(settings.data_dir / "etcd", die_with_parent=False, adopt=True)
    server.start()
    how = "adopted the still running" if server.adopted else "started"
    log.info("%s embedded etcd at %s (pid %s, data in %s)", how, server.endpoint, server.pid, server.data_dir)
    try:
        credentials = embedded_credentials(settings, server.endpoint)
        member = EtcdClient([EtcdEndpoint.from_url(server.endpoint)], credentials=credentials, timeout_s=300)
        shrunk = defragment_if_sparse(member)  # before it serves: defragmenting blocks etcd
        if shrunk is not None:
            log.info("embedded etcd defragmented: %d -> %d bytes", *shrunk)
        yield [server.endpoint], credentials
    finally:
        server.stop()
        log.info("embedded etcd stopped")


def embedded_credentials(settings: Settings, endpoint: str) -> Credentials:
    """root of the embedded etcd: its password from ``<data dir>/etcd-root-password``
    (generated, 0600, at first start), auth turned on if it is off."""
    path = settings.data_dir / ROOT_PASSWORD_FILE
    try:
        password = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        password = ""
    auth = EtcdAuth(EtcdClient([EtcdEndpoint.from_url(endpoint)]))
    if not password:
        if auth.enabled():
            raise SettingsError(
                f"the embedded etcd has auth on but {path} is missing; restore the file, or delete "
                f"{settings.data_dir / 'etcd'} to start with an empty etcd"
            )
        password = secrets.token_urlsafe(32)
        _write_secret(path, password)
    auth.enable(password)
    log.info("embedded etcd: auth on, the service is root (password in %s)", path)
    return Credentials(ROOT_USER, password)


def external_credentials(settings: Settings) -> Credentials | None:
    """The service's etcd user (ELASTRAIN_ETCD_USER/PASSWORD); auth is turned on when it is off
    and the user is root (the chart's own etcd at the first start). None: no password given."""
    if settings.etcd_password is None:
        log.warning(
            "etcd without auth (no ELASTRAIN_ETCD_PASSWORD): every job's code can read and write all "
            "of etcd, the worker-token secret included"
        )
        return None
    credentials = Credentials(settings.etcd_user, settings.etcd_password.get_secret_value())
    bare = EtcdClient([EtcdEndpoint.from_url(u) for u in settings.etcd_endpoints], tls=settings.etcd_tls)
    if settings.etcd_user == ROOT_USER:
        EtcdAuth(bare).enable(credentials.password)
    return credentials


def _write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


def build_app(
    settings: Settings,
    endpoints: list[str],
    *,
    credentials: Credentials | None = None,
    scheduler: Scheduler | None = None,
) -> tuple[FastAPI, Reconciler]:
    """The app and its reconciler (started by the app's lifespan); ``credentials``: the
    service's etcd user (root), None for an etcd without auth."""
    metrics = Metrics()
    etcd = EtcdStore(endpoints, credentials=credentials, tls=settings.etcd_tls)
    wait_for_store(etcd, endpoints)
    store = InstrumentedStore(etcd, metrics)
    token, where = resolve_api_token(settings)
    log.info("API token: %s", where)
    scheduler = scheduler if scheduler is not None else build_scheduler(settings, endpoints)
    election = LeaderElection(
        store,
        holder_id(settings),
        ttl_s=settings.leader_ttl_s,
        address=settings.instance_address,
        workers_address=settings.instance_workers_address or "",
    )
    wake = threading.Event()  # any write of a job wakes the reconciler at once, for that job
    written: set[str] = set()

    def job_written(job_id: str) -> None:
        written.add(job_id)
        wake.set()

    secret = ensure_worker_secret(store)
    policy = Policy(
        heartbeat_timeout_s=settings.heartbeat_timeout_s, startup_timeout_s=settings.startup_timeout_s
    )
    storage = ObjectStorage.from_environ(os.environ)
    parts = JobParts.build(
        store,
        storage_root=settings.checkpoint_root,
        secret=secret,
        object_storage=storage,
        fence_source=lambda: leader_fence(election, wait_s=2 * settings.reconcile_interval_s + 1),
        on_fence_refused=metrics.fenced_refusals.inc,
        write_behind_s=WRITE_BEHIND_S,
        on_write_dropped=metrics.write_behind_dropped.inc,
        on_job_write=job_written,
        heartbeat_write_s=settings.heartbeat_timeout_s / 4,
        merge_window_s=policy.merge_window_s,
    )
    checkpoints = Checkpoints.build(parts.records, metrics=metrics)
    kv = KvGateway(etcd.client, KvBudget.from_settings(settings))
    reconciler = Reconciler(
        parts,
        scheduler,
        election,
        launch=LaunchContext(
            service_url=settings.service_url,
            storage_env=launch_storage_env(storage, kubernetes=settings.scheduler == "kubernetes"),
        ),
        wake=wake,
        written=written,
        metrics=metrics,
        policy=policy,
        interval_s=settings.reconcile_interval_s,
        idle_interval_s=settings.reconcile_idle_interval_s,
        storage=checkpoints.storage,
        kv=kv,
        slots=host_slots(settings.local_slots) if settings.scheduler == "local_cwd" else None,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        reconciler.start()
        try:
            yield
        finally:
            reconciler.stop()

    app = create_app(
        settings,
        store,
        api_token=token,
        parts=parts,
        scheduler=scheduler,
        checkpoints=checkpoints,
        metrics=metrics,
        leader=lambda: reconciler.is_leader,
        stalled=reconciler.stalled,
        forward=LeaderLookup(lambda: leader_address(store)),
        forward_workers=LeaderLookup(lambda: leader_address(store, workers=True)),
        holder=election.holder,
        lifespan=lifespan,
        kv=kv,
    )
    return app, reconciler


_WILDCARDS = {"0.0.0.0": "every IPv4 interface", "::": "every interface", "": "every interface"}


def serving_line(settings: Settings) -> str:
    """What ``serve`` logs at start: the address it listens on (and the workers' listener's),
    and the one workers are told (the advertise URL; for a wildcard host without one, loopback)."""
    where = _WILDCARDS.get(settings.host)
    listens = settings.listen_url + (f" ({where})" if where else "")
    if settings.worker_listen_url is not None:
        listens += f", workers' calls on {settings.worker_listen_url}"
    return (
        f"listening on {listens}; workers reach it at {settings.service_url}; "
        f"checkpoints under {settings.checkpoint_root}"
    )


class _Server(uvicorn.Server):
    """uvicorn's server, whose housekeeping loop wakes once a second instead of ten times (each
    wake-up of the service lands on a core the training ranks use); a shutdown signal still ends
    the wait at once."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000  # on_tick refreshes the Date header when counter % 10 == 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=1.0)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing to wake
                self._loop.call_soon_threadsafe(self._wake.set)

    def open_connections(self) -> int:
        return len(self.server_state.connections)


def uvicorn_config(
    app: FastAPI, host: str, port: int, *, lifespan: Literal["on", "off"], http: type[asyncio.Protocol]
) -> uvicorn.Config:
    """uvicorn's settings for one of the service's listeners: quiet (no access log), ``http``
    the guarded protocol, ``lifespan`` "on" only for the one that runs the reconciler."""
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan=lifespan, http=http
    )


SWITCH_INTERVAL_S = 0.001
"""How long a thread keeps the interpreter while another waits for it, with two event loops in
the process (CPython's default is 5 ms): a loop woken by a request waits at most this long
for the loop that is busy with the workers' calls."""


def bind(host: str, port: int, setting: str) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening); :class:`SettingsError` naming
    ``setting`` when the address cannot be had (in use, not this host's)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SettingsError(
            f"{setting}: cannot listen on {host}:{port} ({exc.strerror}); free the port or choose another"
        ) from None
    sock.set_inheritable(True)
    return sock


@contextlib.contextmanager
def worker_listener(
    settings: Settings, app: FastAPI, sock: socket.socket | None, protocol: type[asyncio.Protocol]
) -> Iterator[_Server | None]:
    """Serve ``app`` on ``sock`` (the workers' port) from an event loop in a thread of its own,
    for as long as the block runs; None and nothing started without a socket. A burst of
    heartbeats from thousands of ranks then queues on that loop, not in front of a user's
    request on the API's. Both loops share the interpreter (the app's state is already
    shared with the request threads), so the switch interval is shortened to
    :data:`SWITCH_INTERVAL_S`. The listener starts before the API's, whose lifespan starts the
    reconciler that launches nodes told this port, and stops after it."""
    if sock is None:
        yield None
        return
    server = _Server(
        uvicorn_config(app, settings.host, settings.worker_port or 0, lifespan="off", http=protocol)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="worker-listener", daemon=True
    )
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    thread.start()
    while not server.started and thread.is_alive():
        time.sleep(0.01)
    try:
        if not server.started:
            raise SettingsError(
                f"ELASTRAIN_WORKER_PORT: the workers' listener on {settings.worker_listen_url} did not start"
            )
        yield server
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(timeout=30)
        sys.setswitchinterval(before)


def connection_limits(settings: Settings, nofile: int) -> ConnectionLimits:
    """What a client connection may hold, under the file limit ``nofile`` (logged once)."""
    cap = connection_cap(nofile, settings.http_max_connections)
    log.info(
        "file limit %d: at most %d client connections; a request's headers within %gs, its body within %gs",
        nofile,
        cap,
        settings.http_header_timeout_s,
        settings.http_body_timeout_s,
    )
    return ConnectionLimits(
        header_timeout_s=settings.http_header_timeout_s,
        body_timeout_s=settings.http_body_timeout_s,
        max_connections=cap,
    )


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


YOUNG_COLLECTION_AFTER = 50_000
"""Net new container objects before a young-generation collection (CPython's default is 700)."""


def collect_less() -> None:
    """Keep the garbage collector out of the requests' way: what exists once the service is
    built (modules, the app) is frozen out of every collection, and collections come after
    :data:`YOUNG_COLLECTION_AFTER` new objects instead of 700. The leader holds thousands of
    decoded job records; with the defaults a full collection walked them every few seconds for
    about a tenth of a second, holding the interpreter while requests and the reconciler's pass
    waited. Garbage without cycles is freed at once either way; cycles wait a little longer."""
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_AFTER, max(middle, 20), old)


def serve(settings: Settings, *, scheduler: Scheduler | None = None) -> int:
    """Run until SIGINT/SIGTERM. Returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal after its graceful shutdown; with this handler that ends
        # in SystemExit, so the scheduler and the embedded etcd below are closed too.
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    settings.checkpoint_root.mkdir(parents=True, exist_ok=True)
    limits = connection_limits(settings, raise_file_limit())
    workers_sock = None
    if settings.worker_port is not None:  # taken first: a port in use fails the start at once
        workers_sock = bind(settings.host, settings.worker_port, "ELASTRAIN_WORKER_PORT")
    with contextlib.ExitStack() as stack:
        if workers_sock is not None:
            stack.callback(workers_sock.close)
        endpoints, credentials = stack.enter_context(etcd_for(settings))
        app, reconciler = build_app(settings, endpoints, credentials=credentials, scheduler=scheduler)
        stack.callback(reconciler.scheduler.close)
        metrics: Metrics = app.state.ctx.metrics
        servers: list[_Server] = []  # the API's and the workers', each counting the other's connections

        def guarded(index: int) -> type[asyncio.Protocol]:
            def elsewhere() -> int:
                return sum(s.open_connections() for i, s in enumerate(servers) if i != index)

            return guarded_protocol(
                limits,
                on_cut=lambda reason: metrics.connections_cut.labels(reason).inc(),
                elsewhere=elsewhere,
            )

        collect_less()
        log.info("%s", serving_line(settings))
        servers.append(
            _Server(uvicorn_config(app, settings.host, settings.port, lifespan="on", http=guarded(0)))
        )
        workers = stack.enter_context(worker_listener(settings, app, workers_sock, guarded(1)))
        if workers is not None:
            servers.append(workers)
        servers[0].run()
    return 0
