"""The Grafana dashboards and the alert rules: generated files are current, the JSON is a
well-formed dashboard, and every metric an expression names is one the worker or the service
actually exports (a renamed metric breaks this test, not a dashboard in production)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from service.metrics import Metrics
from worker.checkpoint import CheckpointStats
from worker.metrics import METRICS, RankMetrics, families

ROOT = Path(__file__).resolve().parents[3]
GRAFANA = ROOT / "deploy" / "grafana"
RULES = ROOT / "deploy" / "prometheus" / "alerts.rules.yml"
NAME = re.compile(r"\belastrain_[a-z0-9_]+")


def generator() -> Any:
    spec = importlib.util.spec_from_file_location("dashboards", GRAFANA / "dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboards() -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(GRAFANA.glob("*.json"))]


def exported_names() -> set[str]:
    """Every sample name the worker exporter and the service (with its additions) produce."""
    rank = RankMetrics(labels={"job_id": "j", "rank": "0", "local_rank": "0", "node": "n"})
    rank.values.update(dict.fromkeys(METRICS, 1.0))
    stats = {f"elastrain_checkpoint_{f.name}": 0.0 for f in dataclasses.fields(CheckpointStats)}
    rank.checkpoint(stats, now=1.0)
    names = {s.name for fam in families([rank.snapshot()]) for s in fam.samples}
    metrics = Metrics()
    for fam in metrics.registry.collect():
        names |= {fam.name, fam.name + "_total", fam.name + "_bucket", fam.name + "_count", fam.name + "_sum"}
    return names


def dashboard_exprs() -> list[str]:
    out = []
    for d in dashboards():
        out += [t["expr"] for p in d["panels"] for t in p["targets"]]
        out += [a["expr"] for a in d["annotations"]["list"] if "expr" in a]
    return out


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


def test_the_committed_json_is_what_the_generator_writes() -> None:
    for path, text in generator().render().items():
        assert path.read_text() == text, f"{path.name} is stale: run python deploy/grafana/dashboards.py"
    assert {p.name for p in GRAFANA.glob("*.json")} == {p.name for p in generator().render()}


def test_four_dashboards_for_the_four_views() -> None:
    titles = {d["uid"]: d["title"] for d in dashboards()}
    assert set(titles) == {
        "elastrain-throughput",
        "elastrain-recovery",
        "elastrain-checkpoints",
        "elastrain-numerics",
    }


@pytest.mark.parametrize("board", dashboards(), ids=lambda d: d["uid"])
def test_dashboard_is_well_formed(board: dict[str, Any]) -> None:
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["schemaVersion"] >= 36
    variables = {v["name"] for v in board["templating"]["list"]}
    assert {"datasource", "job_id"} <= variables
    for p in board["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["title"]
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs))
        assert all(t["expr"].strip() for t in p["targets"])


def test_every_metric_named_in_an_expression_is_exported() -> None:
    known = exported_names()
    for expr in dashboard_exprs() + rule_exprs():
        for name in NAME.findall(expr):
            assert name in known, f"{name!r} in {expr!r} is exported by neither the worker nor the service"


def test_worker_series_are_selected_by_job_id_never_by_job() -> None:
    for expr in dashboard_exprs() + rule_exprs():
        assert 'job="' not in expr and "job=~" not in expr, expr


def test_every_alert_has_a_severity_summary_and_a_promtool_test() -> None:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = {r["alert"]: r for g in groups for r in g["rules"]}
    assert len(alerts) == 8
    tests = yaml.safe_load((RULES.parent / "tests" / "alerts_test.yml").read_text())["tests"]
    tested = {a["alertname"] for t in tests for a in t["alert_rule_test"] if a.get("exp_alerts")}
    assert tested == set(alerts)
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in ("warning", "critical"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
