"""promtool on everything Prometheus reads from this project: the scrape configs, the alert rules
and their unit tests, and the /metrics pages of the worker exporter and of the service app."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from scripts.prometheus_tools import PROMETHEUS_DIR, PrometheusTools, check_all, check_config
from service.api.app import create_app
from service.etcd.memory import MemoryStore
from service.metrics import InstrumentedStore, Metrics
from service.ports import free_port
from service.settings import Settings
from worker.metrics import ExportPlan, WorkerMetrics

pytestmark = pytest.mark.integration
TOKEN = "observability-test-token-0123456789"


def check_metrics(tools: PrometheusTools, page: bytes) -> None:
    proc = tools.promtool_run("check", "metrics", stdin=page)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_configs_rules_and_rule_tests_pass_promtool(prom_tools: PrometheusTools) -> None:
    assert check_all(prom_tools) == []


def test_the_kubernetes_config_is_checked_even_without_kubernetes_sd(
    prom_tools: PrometheusTools, tmp_path: Path
) -> None:
    broken = tmp_path / "prometheus-kubernetes.yml"
    text = (PROMETHEUS_DIR / "prometheus-kubernetes.yml").read_text()
    broken.write_text(text.replace("regex: Running", "regex: Runn(ing"))
    (tmp_path / "alerts.rules.yml").write_text((PROMETHEUS_DIR / "alerts.rules.yml").read_text())
    assert check_config(prom_tools, PROMETHEUS_DIR / "prometheus-kubernetes.yml").returncode == 0
    assert check_config(prom_tools, broken).returncode != 0


def test_worker_exporter_page_passes_promtool(prom_tools: PrometheusTools, tmp_path: Path) -> None:
    peers, targets = tmp_path / "peers", tmp_path / "targets"
    plan = ExportPlan(
        port=0,
        addr="127.0.0.1",
        fallback_free_port=True,
        targets_dir=targets,
        peers_dir=peers,
        local_rank=0,
        restart_count=0,
    )
    peer_plan = ExportPlan(
        port=None,
        addr="127.0.0.1",
        fallback_free_port=True,
        targets_dir=None,
        peers_dir=peers,
        local_rank=1,
        restart_count=0,
    )
    peer = WorkerMetrics(job="promtool", rank=1, world_size=2, plan=peer_plan)
    server = WorkerMetrics(job="promtool", rank=0, world_size=2, plan=plan)
    try:
        for m in (server, peer):
            m.observe_step(0.05, 8, 64, 0.001, comm_s=0.002, step=1)
            m.set_loss(0.5)
            m.set_scale(1024.0, min_scale=1.0)
            m.skipped()
            m.grad_stats(0.01, 1e-7)
            m.peak_memory(1 << 20)
            m.checkpoint(
                {"elastrain_checkpoint_saves_total": 1.0, "elastrain_checkpoint_last_persist_seconds": 0.1}
            )
        peer.flush()
        (target,) = json.loads(next(targets.glob("*.json")).read_text())
        assert target["targets"] == [f"127.0.0.1:{server.port}"]
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as resp:
            page = resp.read()
        assert b'rank="1"' in page and b'rank="0"' in page
        check_metrics(prom_tools, page)
    finally:
        server.close()
    assert not list(targets.glob("*.json")), "a clean exit removes its file_sd target"


@pytest.fixture
def service_url(tmp_path: Path) -> Iterator[tuple[str, Metrics]]:
    """The service app (service.api.app.create_app) with its metrics and an instrumented store,
    under uvicorn on a loopback port."""
    metrics = Metrics()
    store = InstrumentedStore(MemoryStore(), metrics)
    settings = Settings(data_dir=tmp_path / "data", storage_root=tmp_path / "ck", etcd="")
    app = create_app(settings, store, api_token=TOKEN, metrics=metrics)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", metrics
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_service_page_passes_promtool(prom_tools: PrometheusTools, service_url: tuple[str, Metrics]) -> None:
    """The page's format, with the API's and the store's own series (an API-level check: the app
    in process on a store in memory). The recovery series are checked where a real job made
    them: test_observed_run.py (Prometheus, the dashboards and alerts) and test_service_e2e.py
    (promtool on the page of `elastrain serve` after a worker was SIGKILLed)."""
    url, _ = service_url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    spec = {
        "name": "promtool",
        "model": {"name": "mlp"},
        "data": {"name": "synthetic"},
        "micro_batch_size": 8,
        "max_steps": 2,
    }
    assert httpx.post(f"{url}/v1/jobs", json=spec, headers=auth).status_code == 201
    assert httpx.get(f"{url}/v1/jobs/nope", headers=auth).status_code == 404
    assert httpx.get(f"{url}/v1/jobs").status_code == 401
    page = httpx.get(f"{url}/metrics").content
    for name in (b"elastrain_api_requests_total", b"elastrain_etcd_requests_total"):
        assert name in page, name
    check_metrics(prom_tools, page)
