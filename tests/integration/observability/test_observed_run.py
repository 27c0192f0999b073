"""A real Prometheus (Debian's package, on loopback) scrapes a real training job and the real
service, with the configuration shipped in deploy/prometheus; then every PromQL expression of the
dashboards and alert rules is asked for data, and ``elastrain report`` reads the same run.

The job is submitted to ``elastrain serve`` (real etcd, uvicorn and reconciler) and runs as the
service's node would: the worker under torchrun (2 ranks, gloo, fp16, checkpoints every 10
steps), with the environment the service gave the node (its URL, the job's worker token, its
checkpoint directory), so every callback, checkpoint report and recovery event the service
sees comes from the real worker. Only the launching is the test's: the service runs the
file-backed fake scheduler of tests/integration/service, and the test starts the node itself
with ``instrumented_worker.py``, which keeps the workers' exporters up after training so that
Prometheus can be asked while every series is live (the real scheduler launches ``-m worker``,
whose endpoint goes when it ends). Rank 1 is SIGKILLed once and one fp16 step is skipped, so
restarts, the service's recovery (its histogram, phases and rollback), and skipped steps are real.
"""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from scripts.prometheus_tools import PROMETHEUS_DIR, PrometheusServer, PrometheusTools
from service.etcd.server import EtcdServer
from service.jobs.recovery import PHASES
from tests.integration.launch import REPO, worker_env
from tests.integration.observability.promql import exempt_reason, expressions, signals
from tests.integration.service.svc_process import ServiceProcess, wait_for
from worker.metrics import export_plan

pytestmark = pytest.mark.integration
RUNNER = Path(__file__).with_name("instrumented_worker.py")
MAX_STEPS = 40
SPEC: dict[str, Any] = {
    "name": "observed",
    "model": {"name": "tiny-gpt", "kwargs": {"d_model": 16, "n_layers": 1, "n_heads": 2}},
    "data": {"name": "tokens", "samples": 1024, "kwargs": {"vocab_size": 16, "seq_len": 8}},
    "precision": "fp16",
    "micro_batch_size": 8,
    "grad_accum_steps": 2,
    "max_steps": MAX_STEPS,
    "seed": 3,
    "log_every_steps": 1,
    "monitor": {"every_steps": 5, "time_communication": True},
    "checkpoint": {"interval_steps": 10},
    "recovery": {"mode": "restart"},  # the node is launched by hand as a restart-mode node (below)
    "nodes": "1",
    "nproc_per_node": 2,
    "max_restarts": 2,
}
# Attempt 0: rank 0's 5th window overflows (skipped), rank 1 dies in its 25th (after step 23).
FAILPOINTS = "after_grad_sync=nonfinite@0#5^0,after_grad_sync=kill@1#25^0"


@dataclass
class Observed:
    prom: PrometheusServer
    service: ServiceProcess
    run_dir: Path  # the job's checkpoint directory: rank 0 appends its events.jsonl there
    targets: Path
    job: str  # the service's job id: the workers' and the service's job_id label

    @property
    def sel(self) -> str:
        return f'{{job_id="{self.job}"}}'


def prometheus_config(service_port: int, targets: Path) -> str:
    """deploy/prometheus/prometheus.yml with the test's ports, directory and a 1 s interval."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["elastrain-service"]["static_configs"] = [{"targets": [f"127.0.0.1:{service_port}"]}]
    jobs["elastrain-workers"]["file_sd_configs"] = [
        {"files": [str(targets / "*.json")], "refresh_interval": "1s"}
    ]
    return yaml.safe_dump(config)


def value(prom: PrometheusServer, expr: str) -> float | None:
    result = prom.query(expr)
    return float(result[0]["value"][1]) if result else None


def launch_node(svc: ServiceProcess, job: str, tmp: Path) -> subprocess.Popen[bytes]:
    """Start the job's node as the service asked for it (the environment it recorded for the
    launch), running the instrumented worker under torchrun."""
    (tmp / "spec.json").write_text(json.dumps(SPEC))
    env = worker_env(
        svc.launch_env(f"{job}-n0-a0")
        | {
            "ELASTRAIN_METRICS_PORT": "auto",
            "ELASTRAIN_METRICS_ADDR": "127.0.0.1",
            "ELASTRAIN_METRICS_TARGETS_DIR": str(tmp / "targets"),
            "ELASTRAIN_TEST_RELEASE": str(tmp / "release"),
            "ELASTRAIN_FAILPOINTS": FAILPOINTS,
        }
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "--max-restarts=2", "--monitor-interval=0.2", str(RUNNER), "--config", str(tmp / "spec.json"),
    ]  # fmt: skip
    with open(tmp / "worker.stdout", "wb") as out, open(tmp / "worker.stderr", "wb") as err:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=REPO)


@pytest.fixture(scope="module")
def observed(
    prom_tools: PrometheusTools, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Observed]:
    marks = [("start", time.monotonic())]
    mark = lambda what: marks.append((what, time.monotonic()))  # noqa: E731
    tmp = tmp_path_factory.mktemp("observed")
    for sub in ("svc", "prom", "targets"):
        (tmp / sub).mkdir()
    etcd = EtcdServer(tmp / "etcd").start()
    svc = ServiceProcess(tmp / "svc", etcd=etcd.endpoint).start()
    prom = PrometheusServer(prom_tools, tmp / "prom", prometheus_config(svc.port, tmp / "targets")).start()
    proc: subprocess.Popen[bytes] | None = None
    mark("etcd, service, prometheus")
    try:
        with svc.client() as client:
            job: str = client.post("/v1/jobs", json=SPEC).json()["id"]
            wait_for(lambda: f"{job}-n0-a0" in svc.launches(), what="the service to launch the node")
            run_dir = Path(client.get(f"/v1/jobs/{job}").json()["checkpoint_dir"])
            mark("submit and launch")
            proc = launch_node(svc, job, tmp)
            finished = lambda: '"event": "finished"' in (tmp / "worker.stdout").read_text()  # noqa: E731
            wait_for(
                lambda: finished() or proc.poll() is not None, timeout_s=300, what="the worker to finish"
            )
            assert finished(), (tmp / "worker.stderr").read_text()[-3000:]
            mark("worker run")
            wait_for(lambda: client.get(f"/v1/jobs/{job}").json()["restarts"] == 1, what="the recovery")
        mark("recovery recorded")
        wait_for(
            lambda: value(prom, "max(elastrain_worker_step)") == MAX_STEPS, timeout_s=60, what="final scrape"
        )
        mark("final scrape")
        # rate() needs two samples of the live attempt's series in its window: give it five. The
        # killed attempt's series (another port: another instance) went stale with their target
        # but stay in a [1m] window for up to a minute with as few samples as that attempt lived
        # scrapes; `and on(...) live` keeps the live series only (waiting on them took 50 s).
        live = f'elastrain_worker_samples_total{{job_id="{job}"}}'
        samples = f"min(count_over_time({live}[1m]) and on(instance, rank) {live})"
        wait_for(
            lambda: (value(prom, samples) or 0) >= 5, timeout_s=60, what="five scrapes of the last attempt"
        )
        mark("five scrapes")
        wait_for(
            lambda: value(prom, "elastrain_job_recovery_seconds_count") == 1, timeout_s=30, what="service"
        )
        mark("service histogram")
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:  # where a slow setup spends its time, shown
            spent = ", ".join(f"{b} {tb - ta:.1f}" for (_, ta), (b, tb) in itertools.pairwise(marks))
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"[observability] setup (s): {spent}")
        yield Observed(prom, svc, run_dir, tmp / "targets", job)
    finally:
        (tmp / "release").touch()
        if proc is not None:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        prom.stop()
        svc.stop()
        etcd.stop()
    if proc is not None and proc.returncode == 0:  # a clean end leaves nothing in /tmp
        handover = export_plan({"LOCAL_WORLD_SIZE": "2"}, job=job, ppid=proc.pid).peers_dir
        assert handover is not None and not handover.exists(), f"the metrics hand-over {handover} was left"


# ------------------------------------------------------------------ Prometheus


def test_prometheus_scrapes_one_endpoint_per_node_and_the_service(observed: Observed) -> None:
    targets = observed.prom.targets()
    by_job = {t["labels"]["job"]: t for t in targets if t["health"] == "up"}
    assert set(by_job) == {"elastrain-service", "elastrain-workers"}, targets
    assert len(list(observed.targets.glob("*.json"))) == 1  # attempt 0's file went with its process
    ranks = observed.prom.query(f"count by (job_id) (elastrain_worker_world_size{observed.sel})")
    assert float(ranks[0]["value"][1]) == 2  # both local ranks through local rank 0's endpoint


def test_every_dashboard_and_alert_expression_returns_data(observed: Observed) -> None:
    page = httpx.get(f"{observed.service.url}/metrics").text
    missing, exempted = [], []
    for where, expr in expressions():
        for signal in signals(expr):
            reason = exempt_reason(signal, service_page=page)
            if reason is not None:
                exempted.append(f"{where}: {signal}  ({reason})")
            elif not observed.prom.query(signal):
                missing.append(f"{where}: {signal}")
    assert not missing, "no data for:\n" + "\n".join(missing)
    print("\nexempt:\n" + "\n".join(exempted))


def test_worker_series_show_the_run(observed: Observed) -> None:
    prom, sel = observed.prom, observed.sel
    assert value(prom, f"max(elastrain_worker_restarts{sel})") == 1
    assert value(prom, f"max(elastrain_worker_world_size{sel})") == 2
    assert (value(prom, f"min(elastrain_worker_comm_exposed_seconds_total{sel})") or 0) > 0
    assert value(prom, f"min(elastrain_worker_loss_scale{sel})") == 32768.0  # backed off once from 65536
    assert value(prom, f"max(elastrain_worker_loss_scale_min{sel})") == 1.0
    assert value(prom, f"max(elastrain_checkpoint_last_published_step{sel})") == MAX_STEPS
    assert value(prom, f"max(elastrain_checkpoint_restores_total{sel})") == 1
    assert (value(prom, f"sum(elastrain_worker_tokens_total{sel})") or 0) > 0
    # Attempt 0 ran through step 23 and was rolled back to 20: its counters reset with the process.
    assert value(prom, f"max(elastrain_worker_steps_total{sel})") == MAX_STEPS - 20


def test_service_recovery_histogram_has_one_observation(observed: Observed) -> None:
    """What the service measured of the worker's real recovery (no callback posted by the test)."""
    assert value(observed.prom, "elastrain_job_recovery_seconds_count") == 1
    assert value(observed.prom, f"max(elastrain_job_restarts{observed.sel})") == 1
    assert value(observed.prom, f"count(elastrain_job_rollback_steps_total{observed.sel})") == 1
    phases = observed.prom.query("elastrain_job_recovery_phase_seconds_count > 0")
    assert any(r["metric"]["phase"].endswith("first_step") for r in phases), phases
    with observed.service.client() as client:
        record = client.get(f"/v1/jobs/{observed.job}").json()
    assert record["restarts"] == 1 and record["state"] == "RUNNING"
    (recovery,) = record["recoveries"]
    assert recovery["resumed_step"] == 20 and recovery["first_step_at"] is not None, recovery


def test_alert_rules_are_loaded_and_evaluate(observed: Observed) -> None:
    groups = observed.prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"] if r["type"] == "alerting"]
    assert len(rules) == 8 and all(r["health"] == "ok" for r in rules), rules
    firing = {r["name"] for r in rules if r["state"] != "inactive"}
    assert not firing, f"a healthy finished run fires {firing}"


def test_metrics_pages_pass_promtool(observed: Observed, prom_tools: PrometheusTools) -> None:
    (target,) = json.loads(next(observed.targets.glob("*.json")).read_text())
    for url in (f"http://{target['targets'][0]}/metrics", f"{observed.service.url}/metrics"):
        proc = prom_tools.promtool_run("check", "metrics", stdin=httpx.get(url).content)
        assert proc.returncode == 0 and not proc.stdout.strip(), url + proc.stdout + proc.stderr


# ------------------------------------------------------------------ elastrain report


def report(*args: str) -> tuple[str, list[str]]:
    """``elastrain report`` in a fresh interpreter; also returns the modules it imported."""
    driver = (
        "import argparse, sys\n"
        "from service.cli import report\n"
        "p = argparse.ArgumentParser(prog='elastrain'); sub = p.add_subparsers(required=True)\n"
        "report.register(sub); a = p.parse_args(sys.argv[1:]); code = a.func(a)\n"
        "sys.stderr.write('MODULES ' + ' '.join(sorted(sys.modules)) + '\\n'); sys.exit(code)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", driver, "report", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=worker_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = proc.stderr.rsplit("MODULES ", 1)[1].split()
    return proc.stdout, modules


def test_report_text_of_the_killed_run(observed: Observed) -> None:
    text, modules = report(str(observed.run_dir), "--target-loss", "10")
    assert "torch" not in modules
    for needle in (
        "status         finished at step 40",
        "samples/s",
        "tokens/s",
        "p50",
        "p95",
        "p99",
        "per step (worker timing)",
        "exposed comm",
        "of step time",
        "data wait",
        "MiB",
        "time to loss <= 10:",
        "restarts       1",
        "#1 failure",
        "resumed at 20",
        "steps lost",
        "detect+reform+restore",
        "first_step",
        "checkpoints    ",
        "precision      fp16",
        "matmul/linear",
        "environment",
        "torch",
    ):
        assert needle in text, f"{needle!r} not in:\n{text}"
    assert "n/a (the worker did not report it)" not in text


def test_report_json_and_png(observed: Observed, tmp_path: Path) -> None:
    png = tmp_path / "run.png"
    out, _ = report(str(observed.run_dir), "--json", "--png", str(png))
    r = json.loads(out)
    assert r["job"] == "observed" and r["finished"] and r["steps"] == MAX_STEPS and r["world_sizes"] == [2]
    (restart,) = r["restarts"]
    assert restart["kind"] == "failure" and restart["resumed_step"] == 20 and restart["steps_lost"] >= 1
    assert [p["name"] for p in restart["phases"]][-1] == "first_step" and restart["recovery_seconds"] > 0
    assert r["step_seconds"]["p50"] <= r["step_seconds"]["p95"] <= r["step_seconds"]["p99"]
    assert r["throughput"]["samples_per_second"] > 0 and r["throughput"]["tokens_per_second"] > 0
    assert r["comm_exposed_seconds"]["total"] > 0 and r["data_wait_seconds"]["total"] > 0
    assert r["peak_memory_bytes"] > 0 and 0 < r["goodput"] < 1
    assert r["checkpoints"]["published"] >= 3 and r["checkpoints"]["on_disk"]
    assert r["precision_table"]["matmul/linear"]["output"] == "fp16"
    assert r["environment"]["backend"] == "gloo" and r["png"] == str(png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (1000, 600)
    from PIL import Image

    with Image.open(png) as image:
        image.verify()


def test_report_for_a_service_job_adds_the_recoveries_the_service_measured(observed: Observed) -> None:
    svc = observed.service
    args = ("--url", svc.url, "--token-file", str(svc.data_dir / "api-token"))
    out, _ = report(observed.job, "--json", *args)
    service = json.loads(out)["service"]
    assert service["restarts"] == 1 and service["state"] == "RUNNING"
    (recovery,) = service["recoveries"]
    # The phases the service stamped from the worker's events, in the order they happened, each
    # of them ending no earlier than it began (no duration is asserted: only the order).
    names = "+".join(p["name"] for p in recovery["phases"]).split("+")
    assert names == list(PHASES[-len(names) :]) and names[-1] == "first_step", recovery["phases"]
    assert all(p["seconds"] >= 0 for p in recovery["phases"]), recovery["phases"]
    text, _ = report(observed.job, *args)
    assert recovery["kind"] == "restart", recovery
    assert "incident #1" in text and ": restart" in text and "the worker group re-formed" in text
