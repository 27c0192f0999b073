"""What a client connection may hold of the service: deadlines for a request's headers and body,
a cap on open connections, and the file limit they live under.

uvicorn closes an idle keep-alive connection, but waits forever for a request that was begun and
not finished: a client that sends half a request line, or headers and then part of a body, holds
a connection (a file descriptor, a task) for as long as it likes. :func:`guarded_protocol` is
uvicorn's httptools protocol with the two deadlines it lacks: the line and headers must arrive
within ``header_timeout_s`` of the connection (or of the request's first byte on a kept-alive
one), the body within ``body_timeout_s`` of the headers. Past either, the request is answered 408
(when it has no answer yet) and the connection closed, so a request refused early (401 before its
body is read) cannot keep its connection by sending its body a byte at a time either. A
connection beyond ``max_connections`` is answered 503 and closed at once, and the cap stays below
the file limit (:func:`connection_cap`): the service's own files (etcd, checkpoint manifests,
node logs and launches) never run out because of clients. :func:`raise_file_limit` lifts the
soft file limit to the hard one at start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.errors import error_body

log = logging.getLogger("elastrain.connections")

NOFILE_CEILING = 1 << 20
"""The soft limit asked for when the hard one is unlimited (Linux's default ``nr_open``)."""


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


def nofile_target(soft: int, hard: int) -> int:
    """The soft file limit to ask for: the hard limit (a ceiling when that is unlimited), never
    lower than the soft limit already held. Pure."""
    ceiling = NOFILE_CEILING if hard == resource.RLIM_INFINITY else hard
    return soft if soft == resource.RLIM_INFINITY else max(soft, ceiling)


def connection_cap(nofile: int, configured: int) -> int:
    """The most client connections to hold: ``configured``, at most three quarters of the file
    limit ``nofile`` (the rest is the service's own: etcd, checkpoint files, node logs). Pure."""
    return max(min(configured, nofile - max(nofile // 4, 64)), 1)


def raise_file_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now held."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = nofile_target(soft, hard)
    if target != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the file limit from %d to %d: %s", soft, target, exc)
            return soft
    return target


def _answer(status: bytes, code: str, message: str) -> bytes:
    body = json.dumps(error_body(code, message)).encode()
    head = (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n"
    )
    extra = b"retry-after: 2\r\n" if status.startswith(b"503") else b""
    return head + extra + b"\r\n" + body


def guarded_protocol(
    limits: ConnectionLimits,
    *,
    on_cut: Callable[[str], None] = lambda reason: None,
    elsewhere: Callable[[], int] = lambda: 0,
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with ``limits`` (pass it as ``uvicorn.Config(http=...)``);
    ``on_cut(reason)`` hears of every connection it closes (header_timeout, body_timeout,
    over_limit); ``elsewhere()``: the connections the process's other listener holds, which
    count against the same limit (one file limit for both)."""
    too_slow = _answer(
        b"408 Request Timeout",
        "request_timeout",
        f"the request's headers must arrive within {limits.header_timeout_s:g} s and its body within "
        f"{limits.body_timeout_s:g} s (ELASTRAIN_HTTP_HEADER_TIMEOUT_S, ELASTRAIN_HTTP_BODY_TIMEOUT_S); "
        "send the whole request at once",
    )
    too_many = _answer(
        b"503 Service Unavailable",
        "unavailable",
        "the service holds as many client connections as it serves at once "
        "(ELASTRAIN_HTTP_MAX_CONNECTIONS); retry in a few seconds",
    )

    class GuardedHttpTools(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) + elsewhere() > limits.max_connections:
                self._cut("over_limit", too_many)
                return
            self._arm(limits.header_timeout_s, "header_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # a kept-alive connection's next request (the first one's runs)
                self._arm(limits.header_timeout_s, "header_timeout")

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._arm(limits.body_timeout_s, "body_timeout")

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, delay_s: float, reason: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(delay_s, self._expired, reason)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, reason: str) -> None:
            self._deadline = None
            cycle = self.cycle
            answered = cycle is not None and cycle.response_started and reason == "body_timeout"
            if cycle is not None and not cycle.response_complete:
                cycle.disconnected = True  # the app's next receive() says http.disconnect
                cycle.message_event.set()
            self._cut(reason, b"" if answered else too_slow)

        def _cut(self, reason: str, answer: bytes) -> None:
            on_cut(reason)
            if not self.transport.is_closing():
                if answer:
                    self.transport.write(answer)
                self.transport.close()

    return GuardedHttpTools
