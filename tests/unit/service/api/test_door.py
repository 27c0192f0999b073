"""The token is checked from the headers alone: a request without one is refused before any of
its body is read, and the public paths stay open."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from service.api.auth import at_the_door
from service.api.door import Door
from service.jobs.tokens import derive_worker_token, hash_token
from tests.unit.service.api_client import AUTH, SPEC, api

SECRET = b"s" * 32
API = "a" * 32
PUBLIC = frozenset({"/healthz", "/metrics"})


def door(path: str, header: str | None) -> tuple[int, str | None] | None:
    d = at_the_door(path, header, public=PUBLIC, api_token_hash=hash_token(API), secret=SECRET)
    return None if d is None else (d.status, d.principal)


def test_public_paths_need_no_token() -> None:
    assert door("/healthz", None) is None
    assert door("/metrics", "Bearer wrong") is None


def test_the_api_token_comes_in_anywhere_else() -> None:
    for path in ("/v1/jobs", "/v1/jobs/j1", "/v1/jobs/j1/workers/heartbeat", "/nowhere"):
        assert door(path, f"Bearer {API}") == (200, "api")
        assert door(path, None) == (401, None)
        assert door(path, "Bearer wrong") == (401, None)
        assert door(path, f"Basic {API}") == (401, None)


def test_a_worker_token_comes_in_only_under_its_own_job() -> None:
    mine = f"Bearer {derive_worker_token(SECRET, 'j1')}"
    assert door("/v1/jobs/j1/workers/heartbeat", mine) == (200, "worker")
    assert door("/v1/jobs/j1/resume", mine) == (200, "worker")
    assert door("/v1/jobs/j2/resume", mine) == (403, None)
    assert door("/v1/jobs", mine) == (403, None)
    forged = f"Bearer {derive_worker_token(b'other secret', 'j1')}"
    assert door("/v1/jobs/j1/resume", forged) == (401, None)


def _call(app: Any, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[list[dict[str, Any]], bool]:
    """Run ``app`` on one request whose body must not be read; returns what it sent and
    whether the inner app was reached."""
    sent: list[dict[str, Any]] = []
    reached = [False]

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        reached[0] = True

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    middleware = app(inner)
    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(middleware(scope, receive, send))
    return sent, reached[0]


def test_a_refused_request_is_answered_without_reading_its_body() -> None:
    refused: list[str] = []

    def app(inner: Any) -> Door:
        return Door(
            inner, public=PUBLIC, api_token_hash=hash_token(API), secret=SECRET, on_refused=refused.append
        )

    sent, reached = _call(app, "/v1/jobs", [(b"content-length", b"1048576")])
    assert not reached and sent[0]["status"] == 401
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "unauthenticated"
    assert refused == ["unauthenticated"]
    _, reached = _call(app, "/v1/jobs", [(b"authorization", f"Bearer {API}".encode())])
    assert reached


def test_without_a_token_a_bad_or_oversized_body_is_still_401(tmp_path: Path) -> None:
    with api(tmp_path) as client:
        deep = b"[" * 10_000 + b"]" * 10_000
        too_big = b"x" * (2 << 20)
        for body in (deep, too_big, json.dumps(SPEC).encode()):
            resp = client.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
            assert resp.status_code == 401, resp.text
            assert resp.json()["error"]["code"] == "unauthenticated"
        assert client.get("/v1/jobs", headers=AUTH).json()["jobs"] == []
        assert client.get("/healthz").status_code == 200
        assert client.get("/openapi.json").status_code == 200
        assert 'elastrain_api_errors_total{code="unauthenticated"} 3.0' in client.get("/metrics").text
