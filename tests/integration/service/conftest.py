"""Fixtures for the control plane's integration tests: real etcd, the real service in a
subprocess (uvicorn on a free port) with a file-backed fake scheduler, an httpx client.

Why the fake scheduler here: these tests are about the API (status codes, errors, tokens,
forwarding), the job records and leadership; a real node (torchrun and its workers) costs seconds
and nothing these tests check depends on it, while the fake lets a test set a node's status and
count launches exactly. Launching and recovering for real is tested by test_service_e2e.py and
tests/faults/test_real_service.py (the `elastrain` console script, local TorchX, torchrun)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from svc_process import ServiceProcess

from service.etcd.server import EtcdServer
from tests.integration.service.tls_etcd import tls_etcd  # noqa: F401 - a fixture of this directory


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A single-member etcd for the whole session; tests isolate themselves by key prefix."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    with server:
        yield server


@pytest.fixture(scope="session")
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    return etcd_server.endpoint


@pytest.fixture
def etcd_prefix(request: pytest.FixtureRequest) -> str:
    """A key prefix unique to the test, so tests sharing the session etcd never collide."""
    return f"/test/{request.node.name}/{time.time_ns()}"


@pytest.fixture
def fresh_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of the test's own (the service's keys are global)."""
    with EtcdServer(tmp_path / "etcd") as server:
        yield server


@pytest.fixture(scope="module")
def module_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One service (and its own etcd) shared by a module's tests."""
    workdir = tmp_path_factory.mktemp("service")
    with EtcdServer(workdir / "etcd") as etcd:
        proc = ServiceProcess(workdir, etcd=etcd.endpoint).start()
        try:
            yield proc
        finally:
            proc.stop()
