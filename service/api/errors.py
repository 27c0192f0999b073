"""Every error becomes one JSON shape, here and nowhere else:

    {"error": {"code": "not_found", "message": "<what is wrong and how to fix it>", "field": null}}

Known errors map to 4xx (or 503 while etcd is unreachable); an unexpected exception is logged
with its traceback, counted, and answered 500 without internals. :class:`ErrorResponse` is that
shape as a model: every route declares it (through :func:`error_responses`) for each error status
it can answer, so the OpenAPI schema describes the bodies the service really sends.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Send

from service.jobs.errors import (
    ConflictError,
    InvalidRequestError,
    JobEndedError,
    NotFoundError,
    NotLeaderError,
    OverBudgetError,
)
from service.jobs.machine import IllegalTransitionError
from service.jobs.paths import PathError
from worker.checkpoint.storage import StorageError
from worker.errors import ElastrainError, SpecError
from worker.etcdclient import EtcdUnavailableError

log = logging.getLogger("elastrain.api")


class ApiError(Exception):
    """An HTTP error with a message for a person; raise it from routes and dependencies."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.headers = headers or {}


class ErrorDetail(BaseModel):
    code: str = Field(description="A stable name for the kind of error, e.g. not_found, invalid_request.")
    message: str = Field(description="What is wrong and how to fix it, for a person.")
    field: str | None = Field(description="The offending field as a dotted path, when one is to blame.")


class ErrorResponse(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


_STATUS_TEXT = {
    400: "Malformed request: the body is not valid JSON",
    401: "Missing or wrong bearer token",
    403: "The token is not allowed here (a worker token outside its own job's callbacks)",
    404: "Unknown job",
    409: "Conflicts with the job's state, or lost a race that retrying resolves",
    413: "Request body over the size limit (ELASTRAIN_MAX_BODY_BYTES)",
    422: "Invalid field, path, parameter, or a body nested too deep",
    429: "A job's workers are over their budget (requests, bytes, open checkpoint rounds); retry later",
    501: "Not supported by this service's scheduler or configuration",
    503: "etcd is unreachable or this instance is not the leader; retry",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` entries for ``statuses``, each with the :class:`ErrorResponse` body."""
    return {status: {"model": ErrorResponse, "description": _STATUS_TEXT[status]} for status in statuses}


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """The JSON of an :class:`ErrorResponse` (built by hand: it is on every error path)."""
    return {"error": {"code": code, "message": message, "field": field}}


async def send_error(
    send: Send,
    status: int,
    code: str,
    message: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    *,
    field: str | None = None,
) -> None:
    """Answer with an :class:`ErrorResponse` from raw ASGI middleware (outside FastAPI's routes
    and exception handlers)."""
    body = json.dumps(error_body(code, message, field)).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


def _field_of_spec_error(message: str) -> str | None:
    if message.startswith("field '"):
        return message[len("field '") :].split("'", 1)[0]
    return None


def from_domain(exc: ElastrainError) -> ApiError:
    """The HTTP form of a domain error (pure; unit-tested)."""
    message = str(exc)
    if isinstance(exc, PathError):
        return ApiError(422, "invalid_path", message, field=exc.field)
    if isinstance(exc, SpecError):
        return ApiError(422, "invalid_spec", message, field=_field_of_spec_error(message))
    if isinstance(exc, NotFoundError):
        return ApiError(404, "not_found", message)
    if isinstance(exc, IllegalTransitionError):
        status = 422 if exc.code == "out_of_range" else 409
        return ApiError(status, exc.code, message, field="nodes" if exc.code == "out_of_range" else None)
    if isinstance(exc, InvalidRequestError):
        return ApiError(422, "invalid_request", message, field=exc.field)
    if isinstance(exc, JobEndedError):
        return ApiError(409, "job_finished", message)
    if isinstance(exc, ConflictError):
        return ApiError(409, "conflict", message)
    if isinstance(exc, OverBudgetError):
        retry = str(max(1, math.ceil(exc.retry_after)))
        return ApiError(429, "too_many_requests", message, headers={"Retry-After": retry})
    if isinstance(exc, (EtcdUnavailableError, NotLeaderError)):
        return ApiError(503, "unavailable", f"{message}; retry in a few seconds")
    if isinstance(exc, StorageError):  # the object store did not answer: not the request's fault
        return ApiError(503, "storage_unavailable", f"object storage: {message}; retry in a few seconds")
    return ApiError(400, "bad_request", message)


_HINTS = {
    "missing": "add it",
    "extra_forbidden": "remove it",
    "int_type": "give a whole number without quotes",
    "int_parsing": "give a whole number",
    "float_type": "give a number without quotes",
    "string_type": "give a string",
    "bool_type": "give true or false",
    "greater_than_equal": "give a larger value",
    "greater_than": "give a larger value",
    "less_than_equal": "give a smaller value",
    "literal_error": "use one of the listed values",
}


def from_validation(errors: list[Any]) -> ApiError:
    """FastAPI's request validation errors as one 4xx (malformed JSON is 400)."""
    if any(e.get("type") == "json_invalid" for e in errors):
        return ApiError(400, "malformed_json", "the request body is not valid JSON; fix its syntax")
    if any(tuple(e.get("loc", ())) == ("body",) and e.get("type") != "missing" for e in errors):
        return ApiError(
            422,
            "invalid_request",
            "the request body must be a JSON object; send it with 'Content-Type: application/json'",
            field="body",
        )
    parts, first_field = [], None
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p not in ("body", "query", "path", "header")]
        name = ".".join(loc) or "body"
        first_field = first_field or name
        hint = _HINTS.get(str(e.get("type")))
        parts.append(f"field '{name}': {e.get('msg', 'invalid')}" + (f"; {hint}" if hint else ""))
    return ApiError(422, "invalid_request", "; ".join(parts), field=first_field)


def from_http(status: int, detail: str) -> ApiError:
    """Starlette's and FastAPI's own HTTP errors, in our words (pure)."""
    if status == 404:
        return ApiError(404, "not_found", "no such route; see /openapi.json")
    if status == 405:
        return ApiError(405, "method_not_allowed", f"{detail}; see /openapi.json for the methods")
    if status == 400:  # FastAPI could not decode the body (e.g. bytes that are not UTF-8)
        message = "the request body is not valid JSON in UTF-8; fix its encoding"
        return ApiError(400, "malformed_json", message)
    return ApiError(status, "http_error", detail)


def error_response(err: ApiError, on_error: Callable[[str], None]) -> JSONResponse:
    """The answer to ``err``; ``on_error(code)`` counts it (the handlers :func:`install` registers,
    and a route's handler called from outside FastAPI's exception handling)."""
    on_error(err.code)
    body = error_body(err.code, err.message, err.field)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def install(app: FastAPI, on_error: Callable[[str], None]) -> None:
    """Register the handlers; ``on_error(code)`` counts every error response."""

    def respond(err: ApiError) -> JSONResponse:
        return error_response(err, on_error)

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return respond(exc)

    async def domain(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ElastrainError)
        return respond(from_domain(exc))

    async def validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return respond(from_validation(list(exc.errors())))

    async def http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return respond(from_http(exc.status_code, str(exc.detail)))

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return respond(ApiError(500, "internal", "internal error; the service log has the details"))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(ElastrainError, domain)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(StarletteHTTPException, http)
    app.add_exception_handler(Exception, unexpected)
