"""``GET /v1/jobs/{id}/logs`` serves a node's own log files and nothing a link leads to
(``ln -s <data-dir>/api-token <node log dir>/x.log`` must not return the API token)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from tests.specs import raw_spec
from tests.unit.service.svc_fakes import FakeScheduler

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.logfiles import tail_lines
from service.etcd.memory import MemoryStore
from service.jobs.model import JobRecord, NodePhase, NodeRecord
from service.settings import load_settings

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SECRET = "the-api-token-nobody-may-read"


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node's directory as the local scheduler lays it out: ``<root>/<launch>/logs``, with a
    secret of the service's next to it."""
    (tmp_path / "api-token").write_text(SECRET)
    logs = tmp_path / "nodes" / "job-n0-a0" / "logs"
    logs.mkdir(parents=True)
    (logs / "stdout.log").write_text("step 1\nstep 2\n")
    (logs / "stderr.log").write_text("warning\n")
    return logs


def test_a_node_logs_are_served_with_their_names(node: Path) -> None:
    assert tail_lines(node, 10) == ["stderr.log: warning", "stdout.log: step 1", "stdout.log: step 2"]
    assert tail_lines(node, 1) == ["stdout.log: step 2"]


def test_a_link_in_the_log_directory_is_not_followed(node: Path, tmp_path: Path) -> None:
    (node / "x.log").symlink_to(tmp_path / "api-token")
    (node / "sub").symlink_to(tmp_path, target_is_directory=True)
    os.mkfifo(node / "pipe.log")  # not a regular file: reading it could block forever
    (node / "real").mkdir()
    (node / "real" / "inner.log").write_text("inner line\n")
    (node / "real" / "y.log").symlink_to(tmp_path / "api-token")
    lines = tail_lines(node, 100)
    assert not any(SECRET in line for line in lines), lines
    assert "real/inner.log: inner line" in lines
    refused = {line.split(":")[0] for line in lines if "not served" in line}
    assert refused == {"x.log", "sub", "pipe.log", "real/y.log"}, lines


@pytest.mark.parametrize("link", ["logs", "node"])
def test_a_linked_log_or_node_directory_serves_nothing(node: Path, tmp_path: Path, link: str) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "logs").mkdir(parents=True)
    (elsewhere / "logs" / "x.log").symlink_to(tmp_path / "api-token")
    (elsewhere / "logs" / "plain.log").write_text(SECRET)
    victim = node if link == "logs" else node.parent
    renamed = victim.with_name(victim.name + "-moved")
    victim.rename(renamed)
    victim.symlink_to(elsewhere / "logs" if link == "logs" else elsewhere, target_is_directory=True)
    lines = tail_lines(node, 100)
    assert not any(SECRET in line for line in lines), lines
    assert lines and "not served" in lines[0]


class LoggingScheduler(FakeScheduler):
    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def log_dir(self, handle: str) -> Path | None:
        return self.directory


def test_the_route_serves_no_linked_file(node: Path, tmp_path: Path) -> None:
    (node / "x.log").symlink_to(tmp_path / "api-token")
    settings = load_settings(data_dir=tmp_path)
    app = create_app(settings, MemoryStore(), api_token=TOKEN, scheduler=LoggingScheduler(node))
    with TestClient(app, raise_server_exceptions=False) as client:
        spec = raw_spec("demo", max_steps=20)  # fmt: skip
        job = client.post("/v1/jobs", json=spec, headers=AUTH).json()
        ctx = client.app.state.ctx  # type: ignore[attr-defined]

        def launched(record: JobRecord) -> JobRecord:
            running = NodeRecord(index=0, launch_id=f"{record.id}-n0-a0", phase=NodePhase.RUNNING, handle="h")
            return record.model_copy(update={"nodes": (running,)})

        ctx.jobs.update(job["id"], launched)
        resp = client.get(f"/v1/jobs/{job['id']}/logs", headers=AUTH)
        assert resp.status_code == 200, resp.text
        lines = resp.json()["nodes"][f"{job['id']}-n0-a0"]
        assert "stdout.log: step 2" in lines and not any(SECRET in line for line in lines)
