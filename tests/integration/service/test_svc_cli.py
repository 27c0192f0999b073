"""The ``elastrain`` client commands against the real service."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from svc_process import ServiceProcess, job_spec, wait_for

from service.cli import main
from service.etcd.server import EtcdServer

pytestmark = pytest.mark.integration

SPEC = job_spec("cli", "1:2")


def run(svc: ServiceProcess, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--url", svc.url])
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_status_scale_cancel_checkpoints(
    module_service: ServiceProcess,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ELASTRAIN_API_TOKEN", module_service.token)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    code, out, _ = run(module_service, capsys, "submit", str(spec), "-q", "--idempotency-key", "cli-1")
    job_id = out.strip()
    assert code == 0 and job_id.startswith("cli-")
    assert (
        run(module_service, capsys, "submit", str(spec), "-q", "--idempotency-key", "cli-1")[1].strip()
        == job_id
    )
    wait_for(
        lambda: run(module_service, capsys, "status", job_id, "--json")[1].count('"RUNNING"'), what="RUNNING"
    )
    code, out, _ = run(module_service, capsys, "jobs")
    assert code == 0 and job_id in out and "RUNNING" in out
    code, out, _ = run(module_service, capsys, "status", job_id)
    assert code == 0 and "RUNNING" in out and "node 0 attempt 0" in out
    code, out, _ = run(module_service, capsys, "scale", job_id, "--nodes", "1")
    assert code == 0 and "desired nodes 1" in out
    code, out, _ = run(module_service, capsys, "checkpoints", job_id)
    assert code == 0 and out.startswith("      STEP")
    code, out, _ = run(module_service, capsys, "cancel", job_id)
    assert code == 0 and job_id in out
    wait_for(
        lambda: '"CANCELLED"' in run(module_service, capsys, "status", job_id, "--json")[1], what="CANCELLED"
    )
    code, out, _ = run(module_service, capsys, "status", job_id, "--watch", "--interval", "0.1")
    assert code == 1 and "CANCELLED" in out  # --watch exits non-zero unless the job succeeded


def test_errors_are_one_line_without_traceback(module_service: ServiceProcess, tmp_path: Path) -> None:
    env = {**os.environ, "ELASTRAIN_API_TOKEN": module_service.token}
    cli = [sys.executable, "-c", "import sys; from service.cli import main; sys.exit(main())"]
    cases = [
        (["status", "no-such-job"], "404 not_found: no job 'no-such-job'"),
        (["scale", "no-such-job", "--nodes", "2"], "404"),
        (["submit", str(tmp_path / "missing.json")], "cannot read spec file"),
    ]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(SPEC | {"max_steps": "ten"}))
    cases.append((["submit", str(bad)], "field 'max_steps'"))
    for argv, expected in cases:
        proc = subprocess.run(
            [*cli, *argv, "--url", module_service.url], env=env, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("elastrain: error: ") and expected in lines[0], (
            proc.stderr
        )
    unreachable = subprocess.run(
        [*cli, "jobs", "--url", "http://127.0.0.1:9"], env=env, capture_output=True, text=True, timeout=60
    )
    assert unreachable.returncode == 2 and "is `elastrain serve` running?" in unreachable.stderr


def test_submit_is_retried_while_the_leader_does_not_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two real services on one etcd sharing one API token. The leader is SIGSTOPped: the
    standby forwards the submit to it, gets no answer and replies 503; the CLI retries with the
    same Idempotency-Key; once the leader's lease runs out the standby takes over and the retry
    creates the job, once (the paused leader, woken, is fenced off)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    token = secrets.token_urlsafe(24)
    with EtcdServer(tmp_path / "etcd") as etcd:
        a = ServiceProcess(tmp_path / "a", etcd=etcd.endpoint, token=token).start()
        b = ServiceProcess(tmp_path / "b", etcd=etcd.endpoint, token=token).start()
        try:
            wait_for(lambda: httpx.get(f"{a.url}/readyz").json()["leader"], what="a leads")
            monkeypatch.setenv("ELASTRAIN_API_TOKEN", token)
            assert a.proc is not None
            a.proc.send_signal(signal.SIGSTOP)
            result: dict[str, tuple[int, str, str]] = {}
            submit = threading.Thread(
                target=lambda: result.update(r=run(b, capsys, "submit", str(spec), "-q"))
            )
            submit.start()
            wait_for(
                lambda: b.metric("elastrain_api_requests_total", method="POST", status="503") >= 1,
                timeout_s=60,
                what="the standby answers 503",
            )
            submit.join(timeout=120)
            code, out, err = result["r"]
            assert code == 0, err
            with b.client() as client:
                jobs = client.get("/v1/jobs").json()["jobs"]
            assert [j["id"] for j in jobs] == [out.strip()]
        finally:
            if a.proc is not None:
                a.proc.send_signal(signal.SIGCONT)
            a.stop()
            b.stop()
