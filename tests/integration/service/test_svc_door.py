"""Hostile clients beside a healthy job: the service refuses them cheaply and cuts them off.

A real job (one worker process training the MLP on CPU) runs beside the real service while,
in alternate windows, hostile clients (door_clients.py, a process standing in for other
machines) (a) post 1 MiB bodies without a token from four threads, each thirty at most ten a
second, every one answered 401, and (b) hold 300 connections with half a request each (half the
headers, or the headers and half a body), opened again as the service cuts them. The job keeps
training through every attack window, the API answers an authenticated GET during each attack,
and the service closes every half request after its header or body deadline (short ones here).
The job's samples/s with and without clients is printed, not asserted: the tests share the
machine with other tests, so a rate here measures them as much as the service. Traffic is local
(127.0.0.1) and every loop is bounded by its window.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from svc_process import ServiceProcess

from service.etcd.server import EtcdServer
from tests.integration.launch import REPO, worker_env, write_spec

pytestmark = pytest.mark.integration

WINDOW_S = 3.0
BODIES = 30  # a client's in an attack window: at ten a second, the window lasts at least 3 s
WINDOWS = 9  # quiet, attack, quiet, ..., quiet: drift in the machine's load falls on both kinds
HALF_OPEN = 300
TIMEOUTS = {"ELASTRAIN_HTTP_HEADER_TIMEOUT_S": "1.5", "ELASTRAIN_HTTP_BODY_TIMEOUT_S": "1.5"}
GRACE_S = 5.0
CLIENTS = Path(__file__).with_name("door_clients.py")


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceProcess]:
    with EtcdServer(tmp_path / "etcd") as etcd:
        proc = ServiceProcess(tmp_path, etcd=etcd.endpoint, env=TIMEOUTS).start()
        try:
            yield proc
        finally:
            proc.stop()


class Job:
    """A worker process training until stopped; its progress events as (time, samples seen)."""

    def __init__(self, tmp_path: Path) -> None:
        spec = {
            "name": "healthy",
            "model": {"name": "mlp", "kwargs": {"hidden": 32}},
            "data": {"name": "synthetic"},
            "micro_batch_size": 8,
            "max_steps": 10**8,
            "log_every_steps": 1,
        }
        cmd = [sys.executable, "-m", "worker", "--config", str(write_spec(tmp_path, spec))]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        self.progress: list[tuple[float, int]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                event = json.loads(line)
                if event["event"] == "progress":
                    self.progress.append((time.monotonic(), int(event["samples_seen"])))

    def rate(self, start: float, end: float) -> tuple[int, float]:
        """Samples trained and seconds between the first and last report within [start, end]."""
        inside = [p for p in self.progress if start <= p[0] <= end]
        assert len(inside) >= 2, f"the job reported {len(inside)} times in a window; is it training?"
        return inside[-1][1] - inside[0][1], inside[-1][0] - inside[0][0]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def attack(service: ServiceProcess) -> subprocess.Popen[str]:
    """The hostile clients for one window (door_clients.py): its first line ends the window; the
    second comes when the server has closed what they still held, or after the grace."""
    cmd = [sys.executable, str(CLIENTS), "--port", str(service.port), "--bodies", str(BODIES)]
    cmd += ["--half", str(HALF_OPEN), "--grace", str(GRACE_S)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def test_hostile_clients_beside_a_job_are_refused_and_cut(service: ServiceProcess, tmp_path: Path) -> None:
    job = Job(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(job.progress) < 20:
            assert job.proc.poll() is None and time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
        quiet: list[tuple[int, float]] = []
        busy: list[tuple[int, float]] = []
        clients: list[subprocess.Popen[str]] = []
        for window in range(WINDOWS):  # quiet, attack, quiet, ..., quiet
            start = time.monotonic()
            if window % 2:
                clients.append(proc := attack(service))
                time.sleep(WINDOW_S / 2)
                with service.client() as client:
                    listed = client.get("/v1/jobs", timeout=10)
                assert listed.status_code == 200, "the API did not answer during the attack"
                assert proc.stdout is not None and json.loads(proc.stdout.readline()) == {"window": "over"}
                busy.append(job.rate(start, time.monotonic()))
            else:
                time.sleep(WINDOW_S)
                quiet.append(job.rate(start, time.monotonic()))
        for proc in clients:
            out, _ = proc.communicate(timeout=GRACE_S + 30)
            seen = json.loads(out)
            assert seen["statuses"] == [401] * 4 * BODIES, seen["statuses"]
            assert seen["cut"] + seen["held_at_end"] >= HALF_OPEN
            assert seen["still_open"] == 0, f"the service left {seen['still_open']} half requests open"
        assert service.metric("elastrain_api_connections_cut_total", reason="header_timeout") > 0
        assert service.metric("elastrain_api_connections_cut_total", reason="body_timeout") > 0
    finally:
        job.stop()
    quiet_rate = sum(n for n, _ in quiet) / sum(s for _, s in quiet)
    busy_rate = sum(n for n, _ in busy) / sum(s for _, s in busy)
    ratio = busy_rate / quiet_rate
    print(f"\njob samples/s: quiet {quiet_rate:.0f}, under attack {busy_rate:.0f} ({ratio:.3f}x)")
    assert all(n > 0 for n, _ in busy), f"the job stopped training while clients attacked the API: {busy}"
