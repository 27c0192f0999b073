"""Prometheus and promtool for the observability tests and for running the configs in
``deploy/prometheus`` on one machine.

The binaries come from the distribution: Debian's (and Ubuntu's) ``prometheus`` package ships
``/usr/bin/prometheus`` and ``/usr/bin/promtool``. :func:`ensure_tools` finds them on ``PATH``
(or ``$PROMETHEUS_BIN``/``$PROMTOOL_BIN``) and only when they are missing runs
``apt-get update`` and ``apt-get install -y --no-install-recommends prometheus`` (as root, or
through sudo), saying so first. The package's system service is never used: tests start
:class:`PrometheusServer`, a child process on a loopback port with its own storage directory.

Commands (run from the repository root)::

    python -m scripts.prometheus_tools ensure            # find or install, print the paths
    python -m scripts.prometheus_tools check             # promtool check config/rules, test rules
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.ports import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = REPO_ROOT / "deploy" / "prometheus"
APT_PACKAGE = "prometheus"


class PrometheusToolsError(RuntimeError):
    """The tools cannot be found or installed, or the server did not come up."""


@dataclass(frozen=True)
class PrometheusTools:
    prometheus: Path
    promtool: Path

    def promtool_run(self, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[str]:
        """Run promtool; the result carries returncode, stdout and stderr (text)."""
        proc = subprocess.run(
            [str(self.promtool), *args], input=stdin, capture_output=True, check=False, timeout=120
        )
        return subprocess.CompletedProcess(
            proc.args,
            proc.returncode,
            proc.stdout.decode(errors="replace"),
            proc.stderr.decode(errors="replace"),
        )


def find_tools() -> PrometheusTools | None:
    prometheus = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")
    promtool = os.environ.get("PROMTOOL_BIN") or shutil.which("promtool")
    if prometheus and promtool:
        return PrometheusTools(Path(prometheus), Path(promtool))
    return None


def ensure_tools(*, say: Callable[[str], None] = print) -> PrometheusTools:
    """The tools, installing the distribution package once when they are missing."""
    found = find_tools()
    if found is not None:
        return found
    if shutil.which("apt-get") is None:
        raise PrometheusToolsError(
            "prometheus/promtool are not on PATH and this machine has no apt-get: install Prometheus "
            "2.x and put both binaries on PATH (or set PROMETHEUS_BIN and PROMTOOL_BIN)"
        )
    prefix: list[str] = []
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            raise PrometheusToolsError(
                "installing prometheus needs root: run `apt-get install -y prometheus`"
            )
        prefix = ["sudo", "-n"]
    say(f"prometheus/promtool not found: installing the {APT_PACKAGE!r} package with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", APT_PACKAGE],
    ):
        proc = subprocess.run(prefix + cmd, env=env, capture_output=True, text=True, check=False, timeout=900)
        if proc.returncode != 0:
            raise PrometheusToolsError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    found = find_tools()
    if found is None:
        raise PrometheusToolsError(
            f"apt-get installed {APT_PACKAGE} but prometheus/promtool are still not on PATH"
        )
    return found


class PrometheusServer:
    """A throwaway Prometheus: ``config`` is written into ``workdir`` (rule files named there are
    resolved relative to it), storage lives in ``workdir/data``, the API on 127.0.0.1."""

    def __init__(self, tools: PrometheusTools, workdir: Path, config: str) -> None:
        self.tools, self.workdir = tools, workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(config)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60.0) -> PrometheusServer:
        cmd = [
            str(self.tools.prometheus),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        log = open(self.workdir / "prometheus.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(cmd, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PrometheusToolsError(
                    f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise PrometheusToolsError(f"prometheus not ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns ``data`` or raises with Prometheus' error text."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusToolsError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, *, at: float | None = None) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        result: list[dict[str, Any]] = (
            data["result"] if data["resultType"] in ("vector", "matrix") else [data]
        )
        return result

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.api("targets")["activeTargets"]
        return active

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def check_config(tools: PrometheusTools, path: Path) -> subprocess.CompletedProcess[str]:
    """``promtool check config --syntax-only``. Debian's build leaves Kubernetes service discovery
    out; when that is all it objects to, the file is checked again with each
    ``kubernetes_sd_configs`` swapped for an empty static list (so the relabelling is checked)."""
    proc = tools.promtool_run("check", "config", "--syntax-only", str(path))
    if proc.returncode == 0 or "field kubernetes_sd_configs not found" not in proc.stdout + proc.stderr:
        return proc
    import tempfile

    import yaml

    config = yaml.safe_load(path.read_text())
    for job in config.get("scrape_configs", []):
        if job.pop("kubernetes_sd_configs", None) is not None:
            job["static_configs"] = [{"targets": []}]
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / path.name
        copy.write_text(yaml.safe_dump(config))
        for rule_file in config.get("rule_files", []):
            (Path(tmp) / rule_file).write_text((path.parent / rule_file).read_text())
        return tools.promtool_run("check", "config", "--syntax-only", str(copy))


def check_all(tools: PrometheusTools) -> list[str]:
    """promtool check config (each scrape config), check rules and test rules; returns failures."""
    procs = [check_config(tools, p) for p in sorted(PROMETHEUS_DIR.glob("prometheus*.yml"))]
    procs += [tools.promtool_run("check", "rules", str(p)) for p in sorted(PROMETHEUS_DIR.glob("*rules.yml"))]
    procs += [
        tools.promtool_run("test", "rules", str(p)) for p in sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
    ]
    return [f"{' '.join(map(str, p.args))}:\n{p.stdout}{p.stderr}" for p in procs if p.returncode != 0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.prometheus_tools")
    parser.add_argument("command", choices=["ensure", "check"])
    args = parser.parse_args(argv)
    tools = ensure_tools()
    if args.command == "ensure":
        print(f"prometheus {tools.prometheus}\npromtool {tools.promtool}")
        return 0
    failures = check_all(tools)
    for failure in failures:
        print(failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
