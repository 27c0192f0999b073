"""Where a rank's numbers go: the export plan (pure) and the exporter (HTTP, files). See
:mod:`worker.metrics` for the design."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from worker.metrics.comm import CommTimer
from worker.metrics.series import MetricsError, RankMetrics, families

log = logging.getLogger("elastrain.metrics")
DEFAULT_PORT = 9400
DEFAULT_TARGETS_DIR = "/tmp/elastrain/prometheus-targets"


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """Where this process's metrics go. ``port`` None: this process does not serve."""

    port: int | None
    addr: str
    fallback_free_port: bool
    targets_dir: Path | None
    peers_dir: Path | None
    local_rank: int
    restart_count: int


def export_plan(env: Mapping[str, str], *, job: str, ppid: int, tmp: str = "/tmp") -> ExportPlan:
    """Decide from the environment (pure; see the module docstring for the rules)."""
    raw = env.get("ELASTRAIN_METRICS_PORT", "").strip().lower()
    local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1") or 1)
    on_k8s = bool(env.get("KUBERNETES_SERVICE_HOST"))
    if raw in ("0", "off", "false", "no"):
        port: int | None = None
    elif raw in ("", "auto"):
        port = 0 if raw == "auto" else DEFAULT_PORT
    elif raw.isdigit() and int(raw) < 65536:
        port = int(raw)
    else:
        raise MetricsError(f"ELASTRAIN_METRICS_PORT={raw!r}: give a port number, 'auto', or 0/off to disable")
    targets = env.get("ELASTRAIN_METRICS_TARGETS_DIR", None if on_k8s else DEFAULT_TARGETS_DIR)
    safe_job = "".join(c if c.isalnum() or c in "-_." else "_" for c in job)
    peers = Path(tmp) / "elastrain-metrics" / f"{safe_job}-agent{ppid}" if local_world > 1 else None
    return ExportPlan(
        port=port if local_rank == 0 else None,
        addr=env.get("ELASTRAIN_METRICS_ADDR", "0.0.0.0"),
        fallback_free_port=not on_k8s,
        targets_dir=Path(targets) if targets and port is not None and local_rank == 0 else None,
        peers_dir=peers if port is not None else None,
        local_rank=local_rank,
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
    )


def _write_json(path: Path, payload: Any, *, create: bool = True) -> None:
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def stale_peer_dirs(root: Path, *, keep: Path, alive: Callable[[int], bool]) -> list[Path]:
    """The local ranks' hand-over directories under ``root`` (``<job>-agent<pid>``) whose torchrun
    agent is gone, ``keep`` aside: what a run that ended without its serving rank's close left."""
    if not root.is_dir():
        return []
    stale = []
    for path in sorted(root.iterdir()):
        pid = path.name.rpartition("-agent")[2]
        if path != keep and "-agent" in path.name and pid.isdigit() and not alive(int(pid)):
            stale.append(path)
    return stale


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerMetrics:
    """One rank's exporter. Call from the training loop: every method is cheap and none raises
    for I/O trouble (it logs a warning). The constructor raises :class:`MetricsError` only when
    a declared port (Kubernetes) cannot be bound. See the module docstring for the routes."""

    def __init__(
        self, *, job: str, rank: int, world_size: int, plan: ExportPlan, node: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:  # fmt: skip
        self.plan, self.clock = plan, clock
        labels = {"job_id": job, "rank": str(rank), "local_rank": str(plan.local_rank)}
        self.rank = RankMetrics(labels={**labels, "node": node or socket.gethostname()})
        self.job, self.comm = job, CommTimer()
        self._lock = threading.Lock()
        self._last_write = 0.0
        self._server: Any = None
        self._target: Path | None = None
        self.port: int | None = None
        now = clock()
        self._set(elastrain_worker_world_size=world_size, elastrain_worker_restarts=plan.restart_count)
        self._set(elastrain_worker_start_timestamp_seconds=now)
        if plan.port is not None:
            self._serve(plan.port)
        elif plan.peers_dir is not None:
            try:  # created once: after the serving rank removed it at its close, nothing is handed over
                plan.peers_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                log.warning("metrics: cannot create %s: %s", plan.peers_dir, exc)

    @classmethod
    def from_env(
        cls, *, job: str, rank: int, world_size: int, env: Mapping[str, str] | None = None
    ) -> WorkerMetrics:
        plan = export_plan(os.environ if env is None else env, job=job, ppid=os.getppid())
        return cls(job=job, rank=rank, world_size=world_size, plan=plan)

    # ------------------------------------------------------------ what the trainer calls

    def reseat(self, *, rank: int, world_size: int) -> None:
        """Peer mode: this process holds ``rank`` of a group of ``world_size`` now."""
        with self._lock:
            self.rank.labels["rank"] = str(rank)
        self._set(elastrain_worker_world_size=world_size)

    def observe_step(
        self, seconds: float, samples: int, tokens: int = 0, data_wait_s: float = 0.0,
        comm_s: float | None = None, *, step: int | None = None,
    ) -> None:  # fmt: skip
        """One optimizer step (skipped ones too) took ``seconds``; ``comm_s`` None takes the
        exposed communication the :class:`CommTimer` measured since the previous step."""
        exposed, total = self.comm.take()
        with self._lock:
            self.rank.step(
                seconds=seconds, samples=samples, tokens=tokens, data_wait_s=data_wait_s,
                comm_s=(exposed if comm_s is None else comm_s, total), step=step, now=self.clock(),
            )  # fmt: skip
        self._share()

    def set_loss(self, loss: float) -> None:
        self._set(elastrain_worker_loss=loss)

    def set_scale(self, scale: float, *, min_scale: float) -> None:
        """fp16 only (a scaler that is off has no scale worth alerting on)."""
        self._set(elastrain_worker_loss_scale=scale, elastrain_worker_loss_scale_min=min_scale)

    def straggler(self, slowdown: float) -> None:
        """This rank's slowdown in the newest straggler window (:mod:`worker.train.straggler_watch`)."""
        self._set(elastrain_straggler_slowdown=slowdown)

    def skipped(self) -> None:
        with self._lock:
            self.rank.values["elastrain_worker_skipped_steps_total"] += 1

    def integrity(self, seconds: float, *, mismatch: bool) -> None:
        """One comparison of the replicas' state took ``seconds``; ``mismatch``: they disagreed."""
        with self._lock:
            v = self.rank.values
            v["elastrain_worker_integrity_checks_total"] += 1
            v["elastrain_worker_integrity_seconds_total"] += seconds
            v["elastrain_worker_replica_mismatches_total"] += int(mismatch)

    def grad_stats(self, zero_fraction: float, min_nonzero: float) -> None:
        self._set(
            elastrain_worker_grad_zero_ratio=zero_fraction, elastrain_worker_grad_min_nonzero=min_nonzero
        )

    def checkpoint(self, stats: Mapping[str, float]) -> None:
        """``Checkpointer.stats.as_metrics()``; call it every step (cheap) so publishes by the
        background writer are seen within a step."""
        with self._lock:
            self.rank.checkpoint(stats, now=self.clock())

    def peak_memory(self, nbytes: int) -> None:
        self._set(elastrain_worker_peak_memory_bytes=nbytes)

    def progress_fields(self) -> dict[str, Any]:
        """Since the previous call: ``step_seconds`` (list), ``data_wait_seconds``,
        ``comm_exposed_seconds``, ``tokens``, ``peak_memory_bytes``. Merge into ``progress``."""
        with self._lock:
            return self.rank.take_progress_fields()

    def render(self) -> bytes:
        """This node's exposition: own series plus the peers' of the same attempt."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)

    def flush(self) -> None:
        """Hand this rank's newest numbers to the serving rank now (they go at most once a
        second otherwise); call it when training ends."""
        self._share(force=True)

    def close(self) -> None:
        """Stop serving, remove the target file, write a last snapshot (idempotent)."""
        self._share(force=True)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._target is not None:
            self._target.unlink(missing_ok=True)
            self._target = None
        if self.plan.port is not None and self.plan.peers_dir is not None:  # the local ranks' hand-over
            for _ in range(3):  # again if a peer's last write landed during the removal
                shutil.rmtree(self.plan.peers_dir, ignore_errors=True)
                if not self.plan.peers_dir.exists():
                    break

    # ------------------------------------------------------------ internals

    def _set(self, **values: float) -> None:
        with self._lock:
            self.rank.values.update({k: float(v) for k, v in values.items()})

    def snapshots(self) -> list[dict[str, Any]]:
        with self._lock:
            own = self.rank.snapshot()
        return [own, *self._peer_snapshots()]

    def _peer_snapshots(self) -> Iterator[dict[str, Any]]:
        if self.plan.peers_dir is None or not self.plan.peers_dir.is_dir():
            return
        for path in sorted(self.plan.peers_dir.glob("rank-*.json")):
            try:
                snap = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # a peer mid-start or gone: its series return with its next write
            same_attempt = snap.get("restart_count") == self.plan.restart_count
            if same_attempt and snap["labels"]["local_rank"] != str(self.plan.local_rank):
                yield snap

    def _share(self, force: bool = False) -> None:
        """Non-serving local ranks hand their numbers to local rank 0 through a file."""
        if self.plan.peers_dir is None or self.plan.port is not None:
            return
        now = time.monotonic()
        if not force and now - self._last_write < 1.0:
            return
        self._last_write = now
        with self._lock:
            snap = {**self.rank.snapshot(), "restart_count": self.plan.restart_count, "pid": os.getpid()}
        try:
            _write_json(self.plan.peers_dir / f"rank-{self.plan.local_rank}.json", snap, create=False)
        except FileNotFoundError:
            pass  # the serving rank closed (training is over) and took the directory with it
        except OSError as exc:
            log.warning("metrics: cannot write %s: %s", self.plan.peers_dir, exc)

    def _serve(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        try:
            self._server, _ = start_http_server(port, addr=self.plan.addr, registry=registry)
        except OSError as exc:
            if not self.plan.fallback_free_port or port == 0:
                raise MetricsError(
                    f"cannot serve metrics on port {port}: {exc.strerror}; "
                    "set ELASTRAIN_METRICS_PORT to a free port or 0 to disable"
                ) from None
            log.info("metrics: port %d is taken (%s); using a free one", port, exc.strerror)
            self._server, _ = start_http_server(0, addr=self.plan.addr, registry=registry)
        self.port = int(self._server.server_port)
        log.info("metrics: serving /metrics on %s:%d", self.plan.addr, self.port)
        mine = self.plan.peers_dir
        if mine is not None:
            for stale in stale_peer_dirs(mine.parent, keep=mine, alive=_pid_alive):
                shutil.rmtree(stale, ignore_errors=True)
        if self.plan.targets_dir is not None:
            self._register_target(self.plan.targets_dir)

    def _register_target(self, directory: Path) -> None:
        """A file_sd target for a Prometheus on this machine; stale files of dead pids go."""
        safe_job = self.job.replace("/", "_")
        try:
            for old in directory.glob("*.json") if directory.is_dir() else ():
                pid = old.stem.rpartition("-")[2]
                if pid.isdigit() and not _pid_alive(int(pid)):
                    old.unlink(missing_ok=True)
            self._target = directory / f"{safe_job}-{os.getpid()}.json"
            _write_json(self._target, [{"targets": [f"127.0.0.1:{self.port}"], "labels": {}}])
        except OSError as exc:
            log.warning("metrics: cannot write a Prometheus target file in %s: %s", directory, exc)
            self._target = None


class _Collector:
    def __init__(self, owner: WorkerMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterable[Any]:
        return families(self.owner.snapshots())
