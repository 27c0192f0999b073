"""Fixtures for the control plane's integration tests: one real etcd per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.etcd_server import EtcdServer


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
    return f"/test/{request.node.name}/{id(request)}"
