"""Refuse a request body over the limit with 413 before any route parses it.

The whole body (at most ``max_bytes``) is read first, then replayed to the app as one message;
a ``Content-Length`` over the limit is refused without reading anything. A JSON body that no
route may read (nested too deep, a non-finite number, a key twice, an integer of thousands of
digits: :mod:`service.api.jsonbody`) is refused with 422 naming the field, on every route.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import send_error
from service.api.jsonbody import refusal


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared == -1:
            await send_error(send, 400, "bad_request", "the Content-Length header is not a number")
            return
        if declared is not None and declared > self.max_bytes:
            await send_error(send, 413, "body_too_large", self._too_large(declared))
            return
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await send_error(send, 413, "body_too_large", self._too_large(total))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        data = b"".join(chunks)
        refused = refusal(data)
        if refused is not None:
            await send_error(send, refused.status, refused.code, refused.message, field=refused.field)
            return
        body: Message = {"type": "http.request", "body": data, "more_body": False}
        await self.app(scope, _replay([body], receive), send)

    def _too_large(self, size: int) -> str:
        return (
            f"request body of {size} bytes or more is over the limit of {self.max_bytes} bytes "
            "(ELASTRAIN_MAX_BODY_BYTES); send a smaller body"
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
