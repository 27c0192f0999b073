"""ServiceMonitor/PodMonitor, PrometheusRules from deploy/prometheus and the Grafana dashboards
ConfigMap from deploy/grafana (both copied into the chart, since Helm reads only its own dir)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from scripts.deploy_tools import CHART_DIR, DeployTools, chart_file_drift, render_chart
from tests.deploy.helpers import Obj, Renderer, chart_values, find, one, parse_objects

MONITORING_API = ("monitoring.coreos.com/v1",)

SAMPLE_RULES = """\
groups:
  - name: elastrain-jobs
    rules:
      - alert: ElastrainJobStalled
        expr: increase(elastrain_worker_steps_total[10m]) == 0
        for: 5m
        labels: {severity: warning}
        annotations:
          summary: "Job {{ $labels.job_id }} made no step for 10 minutes"
"""
SAMPLE_DASHBOARD = {"title": "elastrain throughput", "uid": "elastrain-throughput", "panels": []}


def test_monitoring_auto_follows_the_cluster(render: Renderer) -> None:
    assert not find(render(), "ServiceMonitor") and not find(render(), "PodMonitor")
    objects = render(api_versions=MONITORING_API)
    assert {o["metadata"]["name"] for o in find(objects, "ServiceMonitor")} == {"elastrain", "elastrain-etcd"}
    assert len(find(objects, "PodMonitor")) == 1
    assert not find(
        render(api_versions=MONITORING_API, set_values=("monitoring.serviceMonitor.enabled=false",)),
        "ServiceMonitor",
    )


def test_service_monitors_select_services_and_ports(render: Renderer) -> None:
    objects = render("everything")  # external etcd: no etcd ServiceMonitor
    monitors = find(objects, "ServiceMonitor")
    assert [m["metadata"]["name"] for m in monitors] == ["elastrain"]
    objects = render(api_versions=MONITORING_API)
    checked = []
    for monitor in find(objects, "ServiceMonitor"):
        checked.append(monitor["metadata"]["name"])
        selected = [
            s
            for s in find(objects, "Service")
            if all(
                s["metadata"]["labels"].get(k) == v
                for k, v in monitor["spec"]["selector"]["matchLabels"].items()
            )
        ]
        assert len(selected) == 1, monitor["metadata"]["name"]
        ports = {p["name"] for p in selected[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
        assert monitor["spec"]["endpoints"] and all(
            e["path"] == "/metrics" for e in monitor["spec"]["endpoints"]
        )
    assert sorted(checked) == ["elastrain", "elastrain-etcd"], "the loop must see both ServiceMonitors"


def test_pod_monitor_scrapes_workers_on_their_metrics_port(render: Renderer) -> None:
    monitor = one(render(api_versions=MONITORING_API), "PodMonitor")
    values = chart_values()["workers"]
    assert monitor["spec"]["selector"]["matchLabels"] == values["selectorLabels"]
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"targetPort": 9400, "path": "/metrics", "interval": "30s"}
    ]
    assert values["metricsPort"] == 9400


def test_labels_for_the_prometheus_selector(render: Renderer) -> None:
    monitors = find(render("everything"), "ServiceMonitor") + find(render("everything"), "PodMonitor")
    names = sorted(f"{m['kind']}/{m['metadata']['name']}" for m in monitors)
    assert names == ["PodMonitor/elastrain-workers", "ServiceMonitor/elastrain"], names
    for monitor in monitors:
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def _chart_with_files(tmp_path: Path) -> Path:
    chart = tmp_path / "elastrain"
    shutil.copytree(CHART_DIR, chart)
    (chart / "files/prometheus").mkdir(parents=True, exist_ok=True)
    (chart / "files/grafana").mkdir(parents=True, exist_ok=True)
    (chart / "files/prometheus/alerts.rules.yml").write_text(SAMPLE_RULES)
    (chart / "files/prometheus/alerts.test.yml").write_text("rule_files: [alerts.rules.yml]\ntests: []\n")
    (chart / "files/grafana/throughput.json").write_text(json.dumps(SAMPLE_DASHBOARD))
    return chart


def test_rule_files_become_prometheus_rules(tools: DeployTools, tmp_path: Path) -> None:
    chart = _chart_with_files(tmp_path)
    objects = parse_objects(render_chart(tools, chart_dir=chart, api_versions=MONITORING_API))
    rule = one(objects, "PrometheusRule")  # the promtool test file is not a rule file
    assert rule["metadata"]["name"] == "elastrain-alerts"
    # Copied verbatim: Prometheus templating such as {{ $labels.job_id }} is not touched by Helm.
    assert rule["spec"] == yaml.safe_load(SAMPLE_RULES)
    without = parse_objects(render_chart(tools, chart_dir=chart))
    assert not find(without, "PrometheusRule")  # auto: the cluster has no CRD


def test_dashboards_become_one_config_map(tools: DeployTools, tmp_path: Path) -> None:
    chart = _chart_with_files(tmp_path)
    objects = parse_objects(render_chart(tools, chart_dir=chart))
    cm: Obj = one(objects, "ConfigMap", "elastrain-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["throughput.json"]) == SAMPLE_DASHBOARD
    off = parse_objects(
        render_chart(tools, chart_dir=chart, set_values=("monitoring.grafanaDashboards.enabled=false",))
    )
    assert not find(off, "ConfigMap", "elastrain-dashboards")


def test_chart_copies_match_deploy_sources() -> None:
    """helm/elastrain/files/{prometheus,grafana} are exact copies of deploy/{prometheus,grafana}."""
    drift = chart_file_drift()
    assert not drift, "\n".join(drift) + "\nrun: .venv/bin/python -m scripts.deploy_tools sync"
