"""The bearer token is checked before anything else of a request is read.

Pure ASGI: :class:`Door` decides from the path and the ``Authorization`` header alone
(:func:`service.api.auth.at_the_door`), so a request without a valid token is answered 401 (or a
worker token outside its job 403) before its body is received, bounded or parsed; a client
without a token costs a hash of its header and one small answer. The routes' own dependencies
still decide which of a job's routes a worker token reaches.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api.auth import at_the_door
from service.api.errors import send_error

_CHALLENGE = [(b"www-authenticate", b"Bearer")]


class Door:
    """ASGI middleware; outside :class:`~service.api.limits.BodyLimit` and the forwarding to the
    leader, so nothing of a refused request's body is read."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        public: frozenset[str],
        api_token_hash: str,
        secret: bytes,
        on_refused: Callable[[str], None] = lambda code: None,
    ) -> None:
        self.app = app
        self.public = public
        self.api_token_hash = api_token_hash
        self.secret = secret
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        decision = at_the_door(
            scope["path"],
            _authorization(scope),
            public=self.public,
            api_token_hash=self.api_token_hash,
            secret=self.secret,
        )
        if decision is None or decision.ok:
            await self.app(scope, receive, send)
            return
        self.on_refused(decision.code)
        headers = _CHALLENGE if decision.status == 401 else []
        await send_error(send, decision.status, decision.code, decision.message, headers)


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return None
