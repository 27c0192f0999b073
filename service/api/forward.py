"""A standby forwards writes to the leader instead of refusing them.

Only the leader writes (every write carries its lease as a fence). Behind one Kubernetes Service
with several replicas, a client's write lands on a standby about as often as not. The CLI retries
a 503, but worker heartbeats and progress are not retried (the next one supersedes them), so
without forwarding a rank whose beats kept landing on the standby could be declared lost. Like
an etcd follower forwarding a proposal, the standby passes the request to the address the leader
published next to its leader key and relays the answer unchanged: the leader checks the token
and applies the write.

A forwarded request carries :data:`FORWARDED_HEADER` and is never forwarded again (no loops
across a change of leader): an instance that is not the leader answers it 503 as before. With no
leader, or one that does not answer within the timeout, the standby answers 503 ("retry"); the
request may then have been applied by the leader, which is why the writes clients retry are
idempotent (submissions by their Idempotency-Key).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import anyio.to_thread
import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.auth import job_of
from service.api.errors import send_error

log = logging.getLogger(__name__)

FORWARDED_HEADER = "x-elastrain-forwarded-by"
_READS = frozenset({"GET", "HEAD", "OPTIONS"})
# Hop-by-hop headers and those httpx sets itself; everything else travels both ways.
_DROP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
        "proxy-authorization",
        "proxy-connection",
    }
)
# uvicorn adds its own date and server; httpx has already decoded the body.
_DROP_ANSWER = _DROP | {"date", "server", "content-encoding"}


def wants_forward(method: str, path: str, headers: Iterable[tuple[bytes, bytes]], *, leading: bool) -> bool:
    """A write to the API reaching an instance that does not lead, and not forwarded already."""
    if leading or method in _READS or not path.startswith("/v1/"):
        return False
    return all(name.lower() != FORWARDED_HEADER.encode() for name, _ in headers)


def forward_target(leader: str | None, own: str) -> str | None:
    """Where to send it: the leader's address, unless there is none or it is this instance
    (a restarted leader taking its own key back handles the request itself)."""
    if not leader or leader.rstrip("/") == own.rstrip("/"):
        return None
    return leader.rstrip("/")


@dataclass
class LeaderLookup:
    """The leader's published address, read from etcd at most every ``max_age_s``."""

    read: Callable[[], str | None]
    max_age_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _cached: tuple[float, str | None] = field(default=(float("-inf"), None), init=False)

    def get(self) -> str | None:
        at, value = self._cached
        if self.clock() - at >= self.max_age_s:
            value = self.read()
            self._cached = (self.clock(), value)
        return value

    def forget(self) -> None:
        self._cached = (float("-inf"), None)


@dataclass(frozen=True)
class WorkersListener:
    """This instance's workers' listener (``ELASTRAIN_WORKER_PORT``): a write that arrives on
    ``port`` goes to the leader's workers' listener (``lookup``: the address it published) when
    it has one, so that forwarded callbacks do not queue in front of the leader's users;
    ``own_url``: this instance's own workers' address."""

    port: int
    lookup: LeaderLookup
    own_url: str


class ForwardToLeader:
    """ASGI middleware; inside :class:`~service.api.limits.BodyLimit`, so the body is bounded."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        leading: Callable[[], bool],
        lookup: LeaderLookup,
        own_url: str,
        holder: str,
        timeout_s: float = 10.0,
        on_forward: Callable[[str], None] = lambda outcome: None,
        forget: Callable[[str], None] = lambda job_id: None,
        workers: WorkersListener | None = None,
    ) -> None:
        self.app = app
        self.leading = leading
        self.lookup = lookup
        self.own_url = own_url
        self.workers = workers
        self.holder = holder
        self.on_forward = on_forward
        self.forget = forget
        """Drops this instance's cached copy of a job the leader just wrote for it (so a client
        that reads back through this instance sees its own write)."""
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=2.0))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not wants_forward(
            scope["method"], scope["path"], scope["headers"], leading=self.leading()
        ):
            await self.app(scope, receive, send)
            return
        workers = (
            self.workers if self.workers is not None and _local_port(scope) == self.workers.port else None
        )
        try:
            target = await anyio.to_thread.run_sync(self._target, workers)
        except Exception as exc:  # etcd unreachable: the route would fail the same way
            log.warning("cannot read the leader's address: %s", exc)
            target = None
        if target is None:
            await self.app(scope, receive, send)  # answers 503 "not the leader" itself
            return
        body = await _read_body(receive)
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        headers = [(k, v) for k, v in headers if k.lower() not in _DROP]
        headers.append((FORWARDED_HEADER, self.holder))
        # The path as the client sent it (still percent-encoded): the leader decodes it once.
        raw_path = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string", b"")
        url = httpx.URL(target).copy_with(raw_path=raw_path + (b"?" + query if query else b""))
        try:
            answer = await self.client.request(scope["method"], url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            self.lookup.forget()
            if self.workers is not None:
                self.workers.lookup.forget()
            self.on_forward("unreachable")
            log.warning(
                "forwarding %s %s to the leader at %s failed: %s", scope["method"], scope["path"], target, exc
            )
            message = (
                f"this instance is not the leader and the leader at {target} did not answer "
                f"({type(exc).__name__}); retry in a few seconds"
            )
            await send_error(send, 503, "unavailable", message, [(b"retry-after", b"2")])
            return
        self.on_forward("forwarded")
        job_id = job_of(scope["path"])
        if job_id is not None:
            self.forget(job_id)
        out = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in answer.headers.multi_items()
            if k.lower() not in _DROP_ANSWER
        ]
        out.append((b"content-length", str(len(answer.content)).encode()))
        await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
        await send({"type": "http.response.body", "body": answer.content})

    def _target(self, workers: WorkersListener | None) -> str | None:
        """Where to forward: the leader's workers' listener for a request that came in on ours
        (when the leader published one), else the leader's address."""
        if workers is not None and (found := workers.lookup.get()):
            return forward_target(found, workers.own_url)
        return forward_target(self.lookup.get(), self.own_url)


def _local_port(scope: Scope) -> int | None:
    """The port of this server the request came in on (uvicorn's ``server``: host and port)."""
    server = scope.get("server")
    return server[1] if server else None


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message: Message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)
