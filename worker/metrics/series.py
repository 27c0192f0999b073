"""One rank's numbers and how a node's ranks render as Prometheus families (pure, no I/O).

Names follow ``elastrain_<subsystem>_<what>_<unit>``: counters end in ``_total``, unix times in
``_timestamp_seconds``. Labels: ``job_id`` (never ``job``, which Prometheus owns), ``rank``,
``local_rank``, ``node``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.errors import ElastrainError

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
    "elastrain_worker_integrity_checks_total": ("counter", "Comparisons of the replicas' state digests"),
    "elastrain_worker_integrity_seconds_total": ("counter", "Time spent hashing and comparing replica state"),
    "elastrain_worker_replica_mismatches_total": ("counter", "Comparisons that found replicas disagreeing"),
    "elastrain_worker_world_size": ("gauge", "Ranks in the worker group"),
    "elastrain_worker_restarts": ("gauge", "torchrun restarts of this worker group so far"),
    "elastrain_worker_start_timestamp_seconds": ("gauge", "Unix time this worker process started"),
    "elastrain_worker_last_step_timestamp_seconds": ("gauge", "Unix time of the newest completed step"),
    "elastrain_straggler_slowdown": (
        "gauge",
        "This rank's compute time per step over the median of the other ranks', in the newest window",
    ),
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
