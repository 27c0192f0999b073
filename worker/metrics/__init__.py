"""The worker's Prometheus metrics: per rank, labelled ``job_id``, ``rank``, ``local_rank``, ``node``.

How they reach Prometheus (the choice, one design for one machine and for Kubernetes):

* Every rank accumulates its own numbers in a :class:`RankMetrics` (plain values, no I/O).
* **One endpoint per node** (per torchrun agent), served by local rank 0 on
  ``ELASTRAIN_METRICS_PORT`` (default 9400; ``0``/``off`` turns the exporter off, ``auto`` binds
  a free port). The other local ranks write their numbers, at most once a second, as JSON into a
  node-local directory (``<tmp>/elastrain-metrics/<job>-agent<torchrun agent pid>/``); local rank
  0 serves its own and its peers' series of the current attempt, and removes the directory
  when it closes (and, when it starts, those of agents that are gone: a run killed before its
  close). So the port count does not grow with ``--nproc-per-node`` and a pod needs one
  declared port.
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

from worker.metrics.comm import CommTimer, peak_memory_bytes
from worker.metrics.exporter import DEFAULT_PORT, DEFAULT_TARGETS_DIR, ExportPlan, WorkerMetrics, export_plan
from worker.metrics.series import (
    LABELS,
    METRICS,
    STEP_BUCKETS,
    STEP_HISTOGRAM,
    MetricsError,
    RankMetrics,
    families,
)

__all__ = [
    "DEFAULT_PORT",
    "DEFAULT_TARGETS_DIR",
    "LABELS",
    "METRICS",
    "STEP_BUCKETS",
    "STEP_HISTOGRAM",
    "CommTimer",
    "ExportPlan",
    "MetricsError",
    "RankMetrics",
    "WorkerMetrics",
    "export_plan",
    "families",
    "peak_memory_bytes",
]
