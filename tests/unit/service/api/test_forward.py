"""Forwarding a standby's writes to the leader: which requests go, where, and the leader's
published address (with the leader key, on its lease). The HTTP path itself runs against two
real services in tests/integration/service/test_svc_forward.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from service.api.forward import (
    FORWARDED_HEADER,
    ForwardToLeader,
    LeaderLookup,
    WorkersListener,
    forward_target,
    job_of,
    wants_forward,
)
from service.etcd.election import LeaderElection, address_key, leader_address
from service.etcd.memory import MemoryStore
from tests.unit.service.svc_fakes import Clock

AUTH = [(b"authorization", b"Bearer t")]


@pytest.mark.parametrize(
    ("method", "path", "headers", "leading", "expected"),
    [
        ("POST", "/v1/jobs", AUTH, False, True),
        ("POST", "/v1/jobs/j/workers/heartbeat", AUTH, False, True),
        ("DELETE", "/v1/jobs/j", AUTH, False, True),
        ("POST", "/v1/jobs", AUTH, True, False),  # the leader applies it
        ("GET", "/v1/jobs/j", AUTH, False, False),  # a standby serves reads
        ("HEAD", "/v1/jobs", AUTH, False, False),
        ("POST", "/metrics", AUTH, False, False),  # not the API
        ("POST", "/v1/jobs", [*AUTH, (FORWARDED_HEADER.encode(), b"b")], False, False),
        ("POST", "/v1/jobs", [(b"X-Elastrain-Forwarded-By", b"b")], False, False),
    ],
)
def test_which_requests_are_forwarded(
    method: str, path: str, headers: list[tuple[bytes, bytes]], leading: bool, expected: bool
) -> None:
    assert wants_forward(method, path, headers, leading=leading) is expected


def test_forward_target_is_the_leader_unless_none_or_this_instance() -> None:
    assert forward_target("http://10.0.0.5:8080/", "http://10.0.0.6:8080") == "http://10.0.0.5:8080"
    assert forward_target("http://10.0.0.6:8080", "http://10.0.0.6:8080/") is None
    assert forward_target(None, "http://10.0.0.6:8080") is None
    assert forward_target("", "http://10.0.0.6:8080") is None


def test_the_leader_publishes_its_address_on_its_lease() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    a = LeaderElection(store, "a", ttl_s=10, address="http://a:8080", clock=clock)
    b = LeaderElection(store, "b", ttl_s=10, address="http://b:8080", clock=clock)
    assert leader_address(store) is None
    assert a.campaign() is not None and b.campaign() is None
    assert leader_address(store) == "http://a:8080"
    clock.advance(11)  # a's lease runs out without a keep-alive: its address goes with it
    assert store.get(address_key()) is None
    assert b.campaign() is not None
    assert leader_address(store) == "http://b:8080"
    b.resign()
    assert leader_address(store) is None


def test_leader_lookup_reads_at_most_once_per_max_age() -> None:
    clock = Clock()
    reads: list[int] = []
    answer = ["http://a:8080"]

    def read() -> str | None:
        reads.append(1)
        return answer[0]

    lookup = LeaderLookup(read, max_age_s=1.0, clock=clock)
    assert lookup.get() == "http://a:8080" and lookup.get() == "http://a:8080"
    assert len(reads) == 1
    answer[0] = "http://b:8080"
    clock.advance(1.0)
    assert lookup.get() == "http://b:8080" and len(reads) == 2
    answer[0] = "http://c:8080"
    lookup.forget()  # after a failed forward: read again at once
    assert lookup.get() == "http://c:8080" and len(reads) == 3


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v1/jobs/j-1/scale", "j-1"),
        ("/v1/jobs/j-1", "j-1"),
        ("/v1/jobs", None),
        ("/v1/jobs/", None),
        ("/v2/jobs/j-1", None),
        ("/healthz", None),
    ],
)
def test_the_job_a_forwarded_write_touched(path: str, expected: str | None) -> None:
    assert job_of(path) == expected


def test_a_leader_publishes_its_workers_listener_beside_its_address_on_its_lease() -> None:
    clock = Clock()
    store = MemoryStore(clock=clock)
    a = LeaderElection(
        store, "a", ttl_s=10, address="http://a:8080", workers_address="http://a:8081", clock=clock
    )
    assert a.campaign() is not None
    assert leader_address(store) == "http://a:8080" and leader_address(store, workers=True) == "http://a:8081"
    a.resign()
    assert leader_address(store, workers=True) is None
    b = LeaderElection(store, "b", ttl_s=10, address="http://b:8080", clock=clock)  # one port
    assert b.campaign() is not None and leader_address(store, workers=True) is None


def _forwarded_to(local_port: int, *, leader_workers: str | None) -> str:
    """The URL a standby's :class:`ForwardToLeader` sends a heartbeat to, when it came in on
    ``local_port`` (its API's 8080 or its workers' 8081). The HTTP hop is a mock transport here;
    tests/integration/service/test_svc_forward.py runs it between two real services."""
    sent: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(str(request.url))
        return httpx.Response(200, json={})

    async def not_reached(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("a standby's write must be forwarded")

    workers = WorkersListener(8081, LeaderLookup(lambda: leader_workers), "http://10.0.0.6:8081")
    middleware = ForwardToLeader(
        not_reached,
        leading=lambda: False,
        lookup=LeaderLookup(lambda: "http://10.0.0.5:8080"),
        own_url="http://10.0.0.6:8080",
        holder="b",
        workers=workers,
    )
    middleware.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    scope = {
        "type": "http", "method": "POST", "path": "/v1/jobs/j/workers/heartbeat",
        "raw_path": b"/v1/jobs/j/workers/heartbeat", "query_string": b"", "headers": AUTH,
        "server": ("10.0.0.6", local_port),
    }  # fmt: skip
    messages: list[Message] = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        return None

    asyncio.run(middleware(scope, receive, send))
    assert len(sent) == 1
    return sent[0].removesuffix("/v1/jobs/j/workers/heartbeat")


def test_a_standby_passes_workers_calls_to_the_leaders_workers_listener() -> None:
    assert _forwarded_to(8081, leader_workers="http://10.0.0.5:8081") == "http://10.0.0.5:8081"
    assert _forwarded_to(8080, leader_workers="http://10.0.0.5:8081") == "http://10.0.0.5:8080"
    # a leader with one port published no workers' listener: its API's port takes them
    assert _forwarded_to(8081, leader_workers=None) == "http://10.0.0.5:8080"
