"""The worker's Prometheus metrics: per rank, labelled ``job_id``, ``rank``, ``local_rank``, ``node``.

How they reach Prometheus (the choice, one design for one machine and for Kubernetes):

* Every rank accumulates its own numbers in a :class:`RankMetrics` (plain values, no I/O).
* **One endpoint per node** (per torchrun agent), served by local rank 0 on
  ``ELASTRAIN_METRICS_PORT`` (default 9400; ``0``/``off`` turns the exporter off, ``auto`` binds
  a free port). The other local ranks write their numbers, at most once a second, as JSON into a
  node-local directory (``<tmp>/elastrain-metrics/<job>-agent<torchrun agent pid>/``); local rank
  0 serves its own and its peers' series of the current attempt. So the port count does not
  grow with ``--nproc-per-node`` and a pod needs one declared port.
* **Kubernetes**: the scheduler declares the port, sets ``ELASTRAIN_METRICS_PORT`` and the
  ``prometheus.io/scrape``/``prometheus.io/port`` annotations; the chart's PodMonitor, or the
  ``kubernetes_sd`` pod job in ``deploy/prometheus/prometheus-kubernetes.yml``, scrapes it. A port
  that cannot be bound is an error there (it is the declared one).
* **One machine**: several agents and jobs share the host, so a taken port falls back to a free
  one, and each exporter writes a Prometheus ``file_sd`` target file
  ``<ELASTRAIN_METRICS_TARGETS_DIR>/<job>-<pid>.json`` (default
  ``/tmp/elastrain/prometheus-targets``; empty disables) that ``deploy/prometheus/prometheus.yml``
  reads. The file goes on a clean exit; files of dead processes are removed by the next exporter.

The label is ``job_id``, not ``job``: Prometheus owns ``job`` (the scrape job) and would rename
ours to ``exported_job``. Names follow ``elastrain_<subsystem>_<what>_<unit>``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.errors import ElastrainError

log = logging.getLogger("elastrain.metrics")
DEFAULT_PORT = 9400
DEFAULT_TARGETS_DIR = "/tmp/elastrain/prometheus-targets"
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LABELS = ("job_id", "rank", "local_rank", "node")
STEP_HISTOGRAM = "elastrain_worker_step_duration_seconds"
# name -> (counter|gauge, help). Counters end in _total; unix times in _timestamp_seconds.
METRICS: dict[str, tuple[str, str]] = {
    "elastrain_worker_steps_total": ("counter", "Optimizer-step windows this rank ran (skipped ones too)"),
    "elastrain_worker_step": ("gauge", "Global step of the newest completed optimizer step"),
    "elastrain_worker_samples_total": ("counter", "Training samples this rank processed"),
    "elastrain_worker_tokens_total": ("counter", "Training tokens this rank processed"),
    "elastrain_worker_samples_per_second": ("gauge", "This rank's samples per second over its last steps"),
    "elastrain_worker_tokens_per_second": ("gauge", "This rank's tokens per second over its last steps"),
    "elastrain_worker_data_wait_seconds_total": ("counter", "Time spent waiting for input batches"),
    "elastrain_worker_comm_exposed_seconds_total": ("counter", "All-reduce time not hidden behind backward"),
    "elastrain_worker_comm_seconds_total": ("counter", "Gradient all-reduce time, overlapped or not"),
    "elastrain_worker_peak_memory_bytes": ("gauge", "Peak memory: allocator peak on GPU, max RSS on CPU"),
    "elastrain_worker_loss": ("gauge", "Training loss (global mean) at the newest reported step"),
    "elastrain_worker_loss_scale": ("gauge", "fp16 dynamic loss scale"),
    "elastrain_worker_loss_scale_min": ("gauge", "The loss scale's configured floor"),
    "elastrain_worker_skipped_steps_total": ("counter", "Steps skipped for non-finite gradients"),
    "elastrain_worker_grad_zero_ratio": ("gauge", "Fraction of gradient elements that are exactly zero"),
    "elastrain_worker_grad_min_nonzero": ("gauge", "Smallest non-zero gradient magnitude"),
    "elastrain_worker_world_size": ("gauge", "Ranks in the worker group"),
    "elastrain_worker_restarts": ("gauge", "torchrun restarts of this worker group so far"),
    "elastrain_worker_start_timestamp_seconds": ("gauge", "Unix time this worker process started"),
    "elastrain_worker_last_step_timestamp_seconds": ("gauge", "Unix time of the newest completed step"),
    "elastrain_checkpoint_last_publish_timestamp_seconds": ("gauge", "Unix time of the newest publish seen"),
}
_CHECKPOINT_PREFIX = "elastrain_checkpoint_"


class MetricsError(ElastrainError):
    """The metrics exporter settings cannot be used (the message names the variable)."""


@dataclass(slots=True)
class RankMetrics:
    """One rank's numbers. Pure: callers pass times in; :meth:`snapshot` is JSON-able."""

    labels: dict[str, str]
    values: dict[str, float] = field(default_factory=dict)
    buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    step_sum: float = 0.0
    recent: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=20))
    pending: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, (kind, _) in METRICS.items():
            if kind == "counter":
                self.values.setdefault(name, 0.0)
        self._reset_pending()

    def _reset_pending(self) -> None:
        self.pending = {
            "step_seconds": [],
            "data_wait_seconds": 0.0,
            "comm_exposed_seconds": 0.0,
            "tokens": 0,
        }

    def step(
        self, *, seconds: float, samples: int, tokens: int, data_wait_s: float, comm_s: tuple[float, float],
        step: int | None, now: float,
    ) -> None:  # fmt: skip
        v = self.values
        v["elastrain_worker_steps_total"] += 1
        v["elastrain_worker_samples_total"] += samples
        v["elastrain_worker_tokens_total"] += tokens
        v["elastrain_worker_data_wait_seconds_total"] += data_wait_s
        v["elastrain_worker_comm_exposed_seconds_total"] += comm_s[0]
        v["elastrain_worker_comm_seconds_total"] += comm_s[1]
        v["elastrain_worker_last_step_timestamp_seconds"] = now
        if step is not None:
            v["elastrain_worker_step"] = step
        self.buckets[next((i for i, b in enumerate(STEP_BUCKETS) if seconds <= b), len(STEP_BUCKETS))] += 1
        self.step_sum += seconds
        self.recent.append((seconds, samples, tokens))
        elapsed = sum(r[0] for r in self.recent)
        if elapsed > 0:
            v["elastrain_worker_samples_per_second"] = sum(r[1] for r in self.recent) / elapsed
            v["elastrain_worker_tokens_per_second"] = sum(r[2] for r in self.recent) / elapsed
        p = self.pending
        if len(p["step_seconds"]) < 10_000:  # bounded if nobody takes the fields
            p["step_seconds"].append(round(seconds, 6))
        p["data_wait_seconds"] += data_wait_s
        p["comm_exposed_seconds"] += comm_s[0]
        p["tokens"] += tokens

    def checkpoint(self, stats: Mapping[str, float], *, now: float) -> None:
        """Take ``CheckpointStats.as_metrics()``; a higher ``saves_total`` means a publish now."""
        saves = "elastrain_checkpoint_saves_total"
        before = self.values.get(saves)
        if before is None or stats.get(saves, 0.0) > before:
            self.values["elastrain_checkpoint_last_publish_timestamp_seconds"] = now
        for name, value in stats.items():
            if name.startswith(_CHECKPOINT_PREFIX):
                self.values[name] = float(value)

    def take_progress_fields(self) -> dict[str, Any]:
        """What happened since the previous call, for the ``progress`` event (and the report)."""
        out = dict(self.pending)
        out["data_wait_seconds"] = round(out["data_wait_seconds"], 6)
        out["comm_exposed_seconds"] = round(out["comm_exposed_seconds"], 6)
        if "elastrain_worker_peak_memory_bytes" in self.values:
            out["peak_memory_bytes"] = int(self.values["elastrain_worker_peak_memory_bytes"])
        self._reset_pending()
        return out

    def snapshot(self) -> dict[str, Any]:
        return {
            "labels": dict(self.labels),
            "values": dict(self.values),
            "histograms": {STEP_HISTOGRAM: {"buckets": list(self.buckets), "sum": self.step_sum}},
        }


def families(snapshots: Sequence[Mapping[str, Any]]) -> list[Any]:
    """Prometheus metric families for the given rank snapshots (one series per rank)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    names = dict(METRICS)
    for snap in snapshots:
        for name in snap["values"]:
            if name not in names and name.startswith(_CHECKPOINT_PREFIX):
                kind = "counter" if name.endswith("_total") else "gauge"
                names[name] = (
                    kind,
                    "Checkpoint engine: " + name[len(_CHECKPOINT_PREFIX) :].replace("_", " "),
                )
    out: list[Any] = []
    for name, (kind, help_) in sorted(names.items()):
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        fam = cls(name, help_, labels=LABELS)
        for snap in snapshots:
            if name in snap["values"]:
                fam.add_metric([snap["labels"][k] for k in LABELS], float(snap["values"][name]))
        if fam.samples:
            out.append(fam)
    hist = HistogramMetricFamily(STEP_HISTOGRAM, "Wall time of one optimizer step", labels=LABELS)
    for snap in snapshots:
        h = snap["histograms"][STEP_HISTOGRAM]
        cumulative, running = [], 0
        for bound, count in zip((*STEP_BUCKETS, float("inf")), h["buckets"], strict=True):
            running += count
            cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(running)))
        hist.add_metric([snap["labels"][k] for k in LABELS], cumulative, sum_value=h["sum"])
    out.append(hist)
    return out


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


def _write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class WorkerMetrics:
    """One rank's exporter. Call from the training loop; every method is cheap and never raises
    for I/O trouble (it logs once). See the module docstring for where the numbers go."""

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

    @classmethod
    def from_env(
        cls, *, job: str, rank: int, world_size: int, env: Mapping[str, str] | None = None
    ) -> WorkerMetrics:
        plan = export_plan(os.environ if env is None else env, job=job, ppid=os.getppid())
        return cls(job=job, rank=rank, world_size=world_size, plan=plan)

    # ------------------------------------------------------------ what the trainer calls

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

    def skipped(self) -> None:
        with self._lock:
            self.rank.values["elastrain_worker_skipped_steps_total"] += 1

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
            _write_json(self.plan.peers_dir / f"rank-{self.plan.local_rank}.json", snap)
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


class CommTimer:
    """A DDP communication hook that all-reduces as DDP's built-in one does (mean by multiplying
    with 1/W) and times it. Bit-identical to the built-in reduction when gradients are set to
    None between steps (the trainer's ``zero_grad(set_to_none=True)``); gradients that persist
    as bucket views are divided in place by DDP instead, which can differ in the last bit.
    *Exposed* time is from the moment the last bucket is launched (backward compute is over)
    until every bucket of that backward has been reduced: the wait nothing overlaps. Register
    before the first backward: ``ddp.register_comm_hook(None, timer.hook)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exposed = self._total = 0.0
        self._pending = 0
        self._last_launch: float | None = None
        self._done = 0.0
        self.hook = self._unannotated_hook()

    def _unannotated_hook(self) -> Callable[[Any, Any], Any]:
        """DDP checks a hook's annotations against ``dist.GradBucket``/``Future``; this module's
        annotations are strings (``from __future__``), so the hook carries none."""

        def hook(process_group: Any, bucket: Any) -> Any:
            return self._launch(process_group, bucket)

        hook.__annotations__ = {}
        return hook

    def _launch(self, process_group: Any, bucket: Any) -> Any:
        import torch.distributed as dist

        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None, "the DDP comm hook runs inside an initialised process group"
        start = time.perf_counter()
        tensor = bucket.buffer()
        tensor.mul_(1.0 / group.size())
        with self._lock:
            if bucket.index() == 0:
                self._last_launch, self._done = None, start
            self._pending += 1
            if bucket.is_last():
                self._last_launch = start
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def finished(fut: Any) -> Any:
            end = time.perf_counter()
            with self._lock:
                self._total += end - start
                self._pending -= 1
                self._done = max(self._done, end)
                if self._pending == 0 and self._last_launch is not None:
                    self._exposed += max(0.0, self._done - self._last_launch)
                    self._last_launch = None
            return fut.value()[0]

        return future.then(finished)

    def take(self) -> tuple[float, float]:
        """(exposed, total) seconds since the previous call."""
        with self._lock:
            out, self._exposed, self._total = (self._exposed, self._total), 0.0, 0.0
            return out


def peak_memory_bytes(device: str) -> int:
    """The device allocator's peak on CUDA; the process's max resident set size on CPU."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
