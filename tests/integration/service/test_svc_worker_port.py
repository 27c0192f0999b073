"""The workers' listener (``ELASTRAIN_WORKER_PORT``) beside the API's, in one real service: both
serve the routes, and their connections count against one limit (one file limit for both)."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from service.etcd.server import EtcdServer
from service.ports import free_port
from tests.integration.service.svc_process import ServiceProcess
from tests.waiting import eventually

pytestmark = pytest.mark.integration

LIMIT = 16  # the smallest ELASTRAIN_HTTP_MAX_CONNECTIONS takes


def first_answer(port: int) -> bytes:
    """The status line and headers a new connection to ``port`` gets for ``GET /healthz``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := conn.recv(4096)):
            answer += chunk
        return answer


def test_both_ports_serve_and_share_one_connection_limit(tmp_path: Path) -> None:
    workers = free_port()
    env = {
        "ELASTRAIN_WORKER_PORT": str(workers),
        "ELASTRAIN_HTTP_MAX_CONNECTIONS": str(LIMIT),
        "ELASTRAIN_HTTP_HEADER_TIMEOUT_S": "120",  # the held connections stay until closed
    }
    with EtcdServer(tmp_path / "etcd") as etcd:
        svc = ServiceProcess(tmp_path, etcd=etcd.endpoint, env=env).start()
        held: list[socket.socket] = []
        try:
            assert httpx.get(f"http://127.0.0.1:{workers}/healthz", timeout=10).status_code == 200

            def fill() -> bool:
                """Open one more idle connection to the workers' port; true once one is refused."""
                conn = socket.create_connection(("127.0.0.1", workers), timeout=10)
                conn.settimeout(0.2)
                try:
                    answer = conn.recv(4096)
                except TimeoutError:  # taken, and waiting for a request
                    held.append(conn)
                    return False
                conn.close()
                return answer.startswith(b"HTTP/1.1 503")

            eventually("the workers' port to refuse a connection over the limit", fill, timeout=60, every=0)
            assert len(held) == LIMIT, "the workers' port holds the whole limit while the API's holds none"
            # The workers' port holds the limit: a user's new connection to the API's is refused.
            refused = first_answer(svc.port)
            assert refused.startswith(b"HTTP/1.1 503"), refused
            assert b"retry-after" in refused.lower()
            for conn in held:
                conn.close()
            held = []
            eventually(
                "the API's port to answer once the workers' connections closed",
                lambda: first_answer(svc.port).startswith(b"HTTP/1.1 200"),
                timeout=30,
                every=0.2,
            )
        finally:
            for conn in held:
                conn.close()
            svc.stop()
