"""Helpers for the control plane's integration tests: the real service (``svc_launcher.py``,
uvicorn on a free port, file-backed fake scheduler) as a child process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.ports import free_port
from tests.specs import raw_spec
from tests.waiting import eventually

ROOT = Path(__file__).resolve().parents[3]
LAUNCHER = Path(__file__).with_name("svc_launcher.py")


QUICK_PASSES = {"ELASTRAIN_RECONCILE_IDLE_INTERVAL_S": "0.5"}
"""For rows that count reconciler passes after a restart: a pass every second (the busy interval)
while the jobs run steadily, instead of every 5 s. What they prove is counted in passes, not
seconds; at the default, waiting for five passes was 20 s of a 29 s row."""


class ServiceProcess:
    """``elastrain serve`` (with the fake scheduler) as a child process."""

    def __init__(
        self, workdir: Path, *, etcd: str, env: dict[str, str] | None = None, token: str | None = None
    ) -> None:
        """``token``: the API token (as replicas share one through ELASTRAIN_API_TOKEN); default,
        the one the service generates in its data dir."""
        self.workdir = workdir
        self.api_token = token
        self.extra_env = env or {}
        self.etcd = etcd
        self.port = free_port()
        self.data_dir = workdir / "data"
        self.nodes_dir = workdir / "nodes"
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServiceProcess:
        # no PYTHONPATH: the launcher imports `service` from the installed distribution
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | self.extra_env
        env.pop("ELASTRAIN_API_TOKEN", None)
        if self.api_token is not None:
            env["ELASTRAIN_API_TOKEN"] = self.api_token
        cmd = [sys.executable, str(LAUNCHER), "--port", str(self.port), "--data-dir", str(self.data_dir)]
        cmd += ["--etcd", self.etcd, "--nodes-dir", str(self.nodes_dir)]
        log = open(self.workdir / "service.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"service not ready in {timeout_s}s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self.workdir / "service.log").read_text(errors="replace")[-2000:]

    @property
    def token(self) -> str:
        return self.api_token or (self.data_dir / "api-token").read_text().strip()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def again(self) -> ServiceProcess:
        """Started again (after :meth:`kill9`, or a death of its own) on the same port, data
        dir, fake scheduler files, etcd and environment."""
        again = ServiceProcess(self.workdir, etcd=self.etcd, env=self.extra_env, token=self.api_token)
        again.port, again.url = self.port, self.url
        return again.start()

    def passes(self) -> float:
        """Reconciler passes so far (``elastrain_reconciler_passes_total``): what the restart rows
        count (see ``QUICK_PASSES``)."""
        return self.metric("elastrain_reconciler_passes_total")

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    # -- the fake scheduler's files --
    def launches(self) -> list[str]:
        """Launch ids the fake scheduler launched, in the order it launched them."""
        if not self.nodes_dir.is_dir():
            return []
        records = [(p.stat().st_mtime_ns, p.stem) for p in self.nodes_dir.glob("*.json")]
        return [launch_id for _, launch_id in sorted(records)]

    def launch_env(self, launch_id: str) -> dict[str, str]:
        env: dict[str, str] = json.loads((self.nodes_dir / f"{launch_id}.json").read_text())["env"]
        return env

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``, from a scrape of
        /metrics as Prometheus would take it; fails when the service exports no such metric."""
        page = httpx.get(f"{self.url}/metrics", timeout=5).text
        suffixes = ("", "_total", "_count", "_sum", "_bucket")
        families = [f for f in text_string_to_metric_families(page) if name in {f.name + x for x in suffixes}]
        assert families, f"{name} is not exported"
        samples = [s for f in families for s in f.samples if s.name == name]
        return sum(s.value for s in samples if labels.items() <= s.labels.items())

    def set_status(
        self, launch_id: str, state: str, exit_code: int | None = None, *, ended_at: float | None = None
    ) -> None:
        (self.nodes_dir / f"{launch_id}.status").write_text(
            json.dumps({"state": state, "exit_code": exit_code, "ended_at": ended_at})
        )


def wait_for(check: Any, *, timeout_s: float = 30.0, what: str = "condition") -> Any:
    """:func:`tests.waiting.eventually`, asked every 0.1 s."""
    return eventually(what, check, timeout_s, every=0.1)


def job_spec(name: str, nodes: str, **more: Any) -> dict[str, Any]:
    """The small job the service tests submit: an MLP on synthetic data, 20 steps of 8 samples."""
    return raw_spec(name, max_steps=20, nodes=nodes) | more
