"""The embedded etcd: starts, answers, remembers its ports, stops."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from service.etcd.server import EtcdServer, EtcdStartError

pytestmark = pytest.mark.integration


def _health(endpoint: str) -> str:
    with urllib.request.urlopen(f"{endpoint}/health", timeout=5) as resp:
        return str(json.loads(resp.read())["health"])


def test_session_etcd_answers(etcd_endpoint: str) -> None:
    assert etcd_endpoint.startswith("http://127.0.0.1:")
    assert _health(etcd_endpoint) == "true"


def test_restart_reuses_ports_and_keeps_data(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    with server:
        first = server.endpoint
        req = urllib.request.Request(
            f"{first}/v3/kv/put", data=b'{"key":"a2V5","value":"dmFs"}', method="POST"
        )
        urllib.request.urlopen(req, timeout=5).close()
    assert not server.running()
    server.stop()  # idempotent
    again = EtcdServer(tmp_path / "etcd")
    with again:
        assert again.endpoint == first
        req = urllib.request.Request(f"{first}/v3/kv/range", data=b'{"key":"a2V5"}', method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.loads(resp.read())["kvs"][0]["value"] == "dmFs"


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path, binary=str(tmp_path / "no-such-etcd"))
    with pytest.raises(EtcdStartError, match="cannot run etcd binary"):
        server.start()


def test_a_surviving_etcd_is_adopted_by_the_next_start(tmp_path: Path) -> None:
    first = EtcdServer(tmp_path / "etcd", die_with_parent=False, adopt=True).start()
    assert not first.adopted
    second = EtcdServer(tmp_path / "etcd", die_with_parent=False, adopt=True).start()
    try:
        assert second.adopted and second.pid == first.pid and second.endpoint == first.endpoint
        assert _health(second.endpoint) == "true"
    finally:
        second.stop()
    assert not second.running() and not first.running()
    third = EtcdServer(tmp_path / "etcd", die_with_parent=False, adopt=True).start()
    try:
        assert not third.adopted and third.endpoint == first.endpoint  # nothing to adopt: a fresh start
    finally:
        third.stop()
