"""Fixtures for the peer-recovery tests: one real etcd for the session, and the uninterrupted
runs' digests (computed once per configuration)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from service.etcd.server import EtcdServer


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EtcdServer(tmp_path_factory.mktemp("etcd")) as server:
        yield server.endpoint


@pytest.fixture(scope="session")
def references() -> dict[tuple[Any, ...], dict[str, Any]]:
    return {}
