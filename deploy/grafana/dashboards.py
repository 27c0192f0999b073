"""Generate the Grafana dashboards in this directory (the JSON files are committed; a test
checks they equal this generator's output).

    python deploy/grafana/dashboards.py          # rewrite the JSON files
    python -m scripts.deploy_tools sync          # then copy them into the Helm chart

Every panel's queries are plain PromQL over the metrics of ``worker/metrics.py`` and the
service (``service/metrics.py``); Grafana variables used: ``$datasource``, ``$job_id`` (a regex
over the ``job_id`` label, which the workers' and the service's per-job series both carry; the
``job`` label is Prometheus's scrape job and never selects a training job) and
``$__rate_interval``/``$__range``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${datasource}"}
J = 'job_id=~"$job_id"'
RI = "$__rate_interval"


def q(expr: str, legend: str = "") -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend}


def panel(
    title: str,
    targets: list[dict[str, Any]],
    *,
    unit: str = "short",
    kind: str = "timeseries",
    description: str = "",
) -> dict[str, Any]:
    return {"title": title, "type": kind, "description": description, "unit": unit, "targets": targets}


def quantiles(metric: str, by: str = "", sel: str = "") -> list[dict[str, Any]]:
    """p50/p95/p99 of a histogram, per ``by`` label (over all series when empty)."""
    selector = f"{{{sel}}}" if sel else ""
    inner = f"sum by ({by + ', ' if by else ''}le) (rate({metric}_bucket{selector}[{RI}]))"
    legend = "".join("{{" + label.strip() + "}} " for label in by.split(",")) if by else ""
    return [q(f"histogram_quantile({p}, {inner})", f"{legend}p{round(p * 100)}") for p in (0.5, 0.95, 0.99)]


def marks(*extra: dict[str, Any]) -> dict[str, Any]:
    base = {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }
    return {"list": [base, *extra]}


def annotation(name: str, expr: str, color: str, *, value_is_time: bool) -> dict[str, Any]:
    """A Prometheus annotation; with ``value_is_time`` the series value (ms) places the mark."""
    return {
        "name": name,
        "datasource": DS,
        "enable": True,
        "expr": expr,
        "iconColor": color,
        "step": "15s",
        "titleFormat": name,
        "textFormat": "{{job_id}}",
        "useValueForTime": value_is_time,
    }


WORKER_RESTARTS = annotation(
    "worker (re)start",
    f"max by (job_id) (elastrain_worker_start_timestamp_seconds{{{J}}}) * 1000",
    "red",
    value_is_time=True,
)
RESCALES = annotation(
    "rescale",
    f"changes(max by (job_id) (elastrain_worker_world_size{{{J}}})[2m:]) > 0",
    "purple",
    value_is_time=False,
)
CHECKPOINTS = annotation(
    "checkpoint published",
    f"max by (job_id) (elastrain_checkpoint_last_publish_timestamp_seconds{{{J}}}) * 1000",
    "grey",
    value_is_time=True,
)

THROUGHPUT = (
    "elastrain-throughput",
    "elastrain: throughput and step latency",
    [
        panel(
            "Samples per second",
            [q(f"sum by (job_id) (rate(elastrain_worker_samples_total{{{J}}}[{RI}]))", "{{job_id}}")],
            unit="reqps",
            description="All ranks of the job together.",
        ),
        panel(
            "Tokens per second",
            [q(f"sum by (job_id) (rate(elastrain_worker_tokens_total{{{J}}}[{RI}]))", "{{job_id}}")],
            unit="short",
        ),
        panel("Step latency", quantiles("elastrain_worker_step_duration_seconds", "job_id", J), unit="s"),
        panel("Global step", [q(f"max by (job_id) (elastrain_worker_step{{{J}}})", "{{job_id}}")]),
        panel(
            "Reported samples per second (service view)",
            [q(f"max by (job_id) (elastrain_job_samples_per_second{{{J}}})", "{{job_id}}")],
            unit="reqps",
            description="What rank 0 last reported to the service (every few seconds).",
        ),
        panel(
            "Data wait share of step time",
            [
                q(
                    f"sum by (job_id) (rate(elastrain_worker_data_wait_seconds_total{{{J}}}[{RI}])) / "
                    f"sum by (job_id) (rate(elastrain_worker_step_duration_seconds_sum{{{J}}}[{RI}]))",
                    "{{job_id}}",
                )
            ],
            unit="percentunit",
        ),
        panel(
            "Exposed communication share of step time",
            [
                q(
                    f"sum by (job_id) (rate(elastrain_worker_comm_exposed_seconds_total{{{J}}}[{RI}])) / "
                    f"sum by (job_id) (rate(elastrain_worker_step_duration_seconds_sum{{{J}}}[{RI}]))",
                    "{{job_id}}",
                )
            ],
            unit="percentunit",
            description="All-reduce time not hidden behind backward compute (DDP comm hook).",
        ),
        panel(
            "Peak memory per rank",
            [
                q(
                    f"max by (job_id, rank) (elastrain_worker_peak_memory_bytes{{{J}}})",
                    "{{job_id}} rank {{rank}}",
                )
            ],
            unit="bytes",
        ),
        panel(
            "Samples per second per rank",
            [
                q(
                    f"max by (job_id, rank) (elastrain_worker_samples_per_second{{{J}}})",
                    "{{job_id}} rank {{rank}}",
                )
            ],
            unit="reqps",
        ),
        panel(
            "Goodput (service estimate)",
            [q(f"elastrain_job_goodput_ratio{{{J}}}", "{{job_id}}")],
            unit="percentunit",
            description="Productive step time over wall time.",
        ),
    ],
    marks(WORKER_RESTARTS, RESCALES),
)

RECOVERY = (
    "elastrain-recovery",
    "elastrain: recovery timeline",
    [
        panel("World size", [q(f"max by (job_id) (elastrain_worker_world_size{{{J}}})", "{{job_id}}")]),
        panel(
            "Worker restarts (torchrun)",
            [q(f"max by (job_id) (elastrain_worker_restarts{{{J}}})", "{{job_id}}")],
        ),
        panel("Jobs by state", [q("sum by (state) (elastrain_jobs)", "{{state}}")]),
        panel(
            "Recovery time by kind (failure to first step)",
            quantiles("elastrain_job_recovery_seconds", "kind"),
            unit="s",
            description=(
                "One incident, from the last sign of life of what was lost to the repaired group's first "
                "step. peer: state from a survivor's memory; storage: from the checkpoint in process; "
                "restart: the workers restarted."
            ),
        ),
        panel(
            "Recoveries in range by kind",
            [q("sum by (kind) (increase(elastrain_job_recovery_seconds_count[$__range]))", "{{kind}}")],
            kind="stat",
        ),
        panel(
            "Recovery phases by kind",
            quantiles("elastrain_job_recovery_phase_seconds", "phase, kind"),
            unit="s",
            description="detect, reform, transfer (peer) or restore, first_step.",
        ),
        panel(
            "State moved by recoveries, by source",
            [
                q(
                    f"sum by (source) (increase(elastrain_job_recovery_bytes_total{{{J}}}[$__range]))",
                    "{{source}}",
                )
            ],
            unit="bytes",
            description="peers: from a survivor's memory; storage: read from the checkpoint.",
        ),
        panel(
            "Windows voided by recoveries",
            [
                q(
                    f"sum by (job_id) (increase(elastrain_job_voided_windows_total{{{J}}}[$__range]))",
                    "{{job_id}}",
                )
            ],
            description="Training windows in flight when a rank was lost: dropped, never applied.",
        ),
        panel(
            "Steps lost to rollback",
            [
                q(
                    f"sum by (job_id) (increase(elastrain_job_rollback_steps_total{{{J}}}[$__range]))",
                    "{{job_id}}",
                )
            ],
        ),
        panel("Nodes per job", [q(f"elastrain_job_nodes{{{J}}}", "{{job_id}}")]),
        panel(
            "Restarts per job (service view)",
            [q(f"max by (job_id) (elastrain_job_restarts{{{J}}})", "{{job_id}}")],
            description="Recoveries that restarted the workers (they use max_restarts; peer ones do not).",
        ),
        panel(
            "API requests by route and status",
            [q(f"sum by (route, status) (rate(elastrain_api_requests_total[{RI}]))", "{{route}} {{status}}")],
            unit="reqps",
        ),
        panel(
            "Reconciler pass duration",
            quantiles("elastrain_reconciler_pass_duration_seconds"),
            unit="s",
        ),
        panel(
            "etcd round trips",
            [q(f"sum by (op, outcome) (rate(elastrain_etcd_requests_total[{RI}]))", "{{op}} {{outcome}}")],
            unit="reqps",
        ),
    ],
    marks(WORKER_RESTARTS, RESCALES, CHECKPOINTS),
)

CHECKPOINT = (
    "elastrain-checkpoints",
    "elastrain: checkpoint cost",
    [
        panel(
            "Blocking vs persist seconds (last save)",
            [
                q(
                    f"max by (job_id) (elastrain_checkpoint_last_blocking_seconds{{{J}}})",
                    "{{job_id}} blocking",
                ),
                q(
                    f"max by (job_id) (elastrain_checkpoint_last_persist_seconds{{{J}}})",
                    "{{job_id}} persist",
                ),
            ],
            unit="s",
            description="Blocking: training waited. Persist: write, fsync, digest, publish.",
        ),
        panel(
            "Bytes written per second",
            [
                q(
                    f"sum by (job_id) (rate(elastrain_checkpoint_bytes_written_total{{{J}}}[{RI}]))",
                    "{{job_id}}",
                )
            ],
            unit="Bps",
        ),
        panel(
            "Bytes written (this attempt)",
            [q(f"sum by (job_id) (elastrain_checkpoint_bytes_written_total{{{J}}})", "{{job_id}}")],
            unit="bytes",
        ),
        panel(
            "Time since the last publish",
            [
                q(
                    f"time() - max by (job_id) (elastrain_checkpoint_last_publish_timestamp_seconds{{{J}}})",
                    "{{job_id}}",
                )
            ],
            unit="s",
        ),
        panel(
            "Auto interval (Young/Daly)",
            [q(f"max by (job_id) (elastrain_checkpoint_interval_seconds{{{J}}})", "{{job_id}}")],
            unit="s",
        ),
        panel(
            "Saves, aborts, verification failures",
            [
                q(f"max by (job_id) (elastrain_checkpoint_saves_total{{{J}}})", "{{job_id}} saves"),
                q(f"max by (job_id) (elastrain_checkpoint_aborts_total{{{J}}})", "{{job_id}} aborts"),
                q(
                    f"max by (job_id) (elastrain_checkpoint_verification_failures_total{{{J}}})",
                    "{{job_id}} refused",
                ),
            ],
        ),
        panel(
            "Service: published and aborted per minute",
            [
                q("sum(rate(elastrain_checkpoints_published_total[5m])) * 60", "published"),
                q("sum(rate(elastrain_checkpoints_aborted_total[5m])) * 60", "aborted"),
            ],
        ),
        panel(
            "Service: publish latency",
            quantiles("elastrain_checkpoint_publish_duration_seconds"),
            unit="s",
        ),
    ],
    marks(CHECKPOINTS, WORKER_RESTARTS),
)

NUMERICS = (
    "elastrain-numerics",
    "elastrain: numerics",
    [
        panel("Loss", [q(f"avg by (job_id) (elastrain_worker_loss{{{J}}})", "{{job_id}}")]),
        panel(
            "Loss scale and its floor",
            [
                q(f"min by (job_id) (elastrain_worker_loss_scale{{{J}}})", "{{job_id}} scale"),
                q(f"max by (job_id) (elastrain_worker_loss_scale_min{{{J}}})", "{{job_id}} floor"),
            ],
            description="fp16 jobs only.",
        ),
        panel(
            "Skipped steps per minute",
            [
                q(
                    f"sum by (job_id) (rate(elastrain_worker_skipped_steps_total{{{J}}}[{RI}])) * 60",
                    "{{job_id}}",
                )
            ],
        ),
        panel(
            "Skipped steps (this attempt)",
            [q(f"max by (job_id) (elastrain_worker_skipped_steps_total{{{J}}})", "{{job_id}}")],
        ),
        panel(
            "Zero-gradient fraction",
            [
                q(
                    f"max by (job_id, rank) (elastrain_worker_grad_zero_ratio{{{J}}})",
                    "{{job_id}} rank {{rank}}",
                )
            ],
            unit="percentunit",
        ),
        panel(
            "Smallest non-zero gradient",
            [q(f"min by (job_id) (elastrain_worker_grad_min_nonzero{{{J}}})", "{{job_id}}")],
            unit="sci",
        ),
    ],
    marks(WORKER_RESTARTS),
)

DASHBOARDS = (THROUGHPUT, RECOVERY, CHECKPOINT, NUMERICS)


def dashboard(uid: str, title: str, panels: list[dict[str, Any]], notes: dict[str, Any]) -> dict[str, Any]:
    out = []
    for i, p in enumerate(panels):
        width = 12 if p["type"] == "timeseries" else 6
        targets = [{"refId": chr(ord("A") + j), "datasource": DS, **t} for j, t in enumerate(p["targets"])]
        out.append(
            {
                "id": i + 1,
                "type": p["type"],
                "title": p["title"],
                "description": p["description"],
                "datasource": DS,
                "gridPos": {"h": 8, "w": width, "x": (i % 2) * 12, "y": (i // 2) * 8},
                "fieldConfig": {"defaults": {"unit": p["unit"]}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": targets,
            }
        )
    job_var = {
        "name": "job_id",
        "label": "job",
        "type": "query",
        "datasource": DS,
        "query": {"query": "label_values(elastrain_worker_step, job_id)", "refId": "job_id"},
        "definition": "label_values(elastrain_worker_step, job_id)",
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
    }
    ds_var = {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"}
    return {
        "uid": uid,
        "title": title,
        "tags": ["elastrain"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "",
        "annotations": notes,
        "templating": {"list": [ds_var, job_var]},
        "panels": out,
    }


def render() -> dict[Path, str]:
    """File -> JSON text for every dashboard."""
    return {
        HERE / f"{uid}.json": json.dumps(dashboard(uid, title, panels, notes), indent=2) + "\n"
        for uid, title, panels, notes in DASHBOARDS
    }


def main() -> int:
    for path, text in render().items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
