"""Schemathesis over the service's OpenAPI schema (real uvicorn, real etcd): whatever the
generated requests hold, the answer is never a 5xx and always matches the schema.

Every operation is driven with positive data (valid per the schema) and negative data (each
case breaks the schema somewhere: a wrong type, a missing field, an unknown field, an
out-of-range number), with the API token; half of the cases of a ``{job_id}`` route name a
live job, so they reach the job's state machine and the checkpoint coordinator, not only 404.
Schemathesis's own checks judge every response: ``not_a_server_error``,
``status_code_conformance`` (a status the operation declares), ``content_type_conformance``,
``response_schema_conformance`` (the body matches the declared schema; every error is our
``ErrorResponse``) and ``response_headers_conformance``; negative cases also get
``negative_data_rejection`` (invalid input is answered 4xx, never 2xx). Operations whose only
input is a free-form string (``GET /v1/jobs/{job_id}``, the health routes) have no negative
cases; the test lists them. A few positive cases per operation go without a token, with a
wrong one, and with another job's worker token: 401, 401 and 403 on every /v1 route. Every
operation with a JSON body also gets schema-valid bodies with one number made NaN, Infinity,
-Infinity or 1e999, or one key given twice (what schemathesis cannot generate: Python's json
writes the first, JSON has no way to say the second): 422 naming that field.

Examples per operation and mode: ``ELASTRAIN_SCHEMATHESIS_EXAMPLES``, default 100 in ``make
test`` (the file takes about 30 s on 2 cores; 200 about 50 s); ``make faults`` runs 500. The
seed is ``ELASTRAIN_SCHEMATHESIS_SEED`` (random by default) and every failure names it.
Shrinking is off to bound the runtime; each failure carries a curl line that reproduces it.
The service is killed if it grows past 1 GiB (a runaway request would take the shared machine
with it) and the test then fails. A 503 ``unavailable`` (the documented "retry in a few
seconds") is retried up to 5 times a second apart before it is judged, and the count is printed.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from svc_process import ServiceProcess, job_spec, wait_for

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("ELASTRAIN_SCHEMATHESIS_EXAMPLES", "100"))
SEED = int(os.environ.get("ELASTRAIN_SCHEMATHESIS_SEED", str(random.randrange(2**32))))
TOKEN_EXAMPLES = 5
RSS_LIMIT = 1 << 30
RETRIES = 5
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
PUBLIC = {"/healthz", "/readyz", "/metrics"}
SPEC: dict[str, Any] = job_spec("fuzzed", "1:3")


class NothingToNegate(Exception):
    """Every input of the operation is a free-form string (or there is none): no case breaks it."""


@pytest.fixture(scope="module")
def service(module_service: ServiceProcess) -> ServiceProcess:
    """The module's service from conftest (real uvicorn on its own real etcd)."""
    return module_service


@pytest.fixture(scope="module")
def operations(service: ServiceProcess) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    # The token is ours to send (or to leave out); schemathesis generates no Authorization header.
    schema.config.generation.update(with_security_parameters=False)
    return [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]  # an invalid schema raises here


@contextmanager
def memory_bounded(svc: ServiceProcess) -> Iterator[list[int]]:
    """SIGKILL the service once its resident memory passes RSS_LIMIT; yields [peak bytes]."""
    assert svc.proc is not None
    pid = svc.proc.pid
    status, peak, done = Path(f"/proc/{pid}/status"), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            try:
                kib = next(line for line in status.read_text().splitlines() if line.startswith("VmRSS"))
            except (OSError, StopIteration):
                return
            peak[0] = max(peak[0], int(kib.split()[1]) * 1024)
            if peak[0] > RSS_LIMIT:
                os.kill(pid, signal.SIGKILL)
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join()
        assert peak[0] <= RSS_LIMIT, f"the service grew to {peak[0] >> 20} MiB and was killed (seed {SEED})"


def _strategy(operation: Any, mode: GenerationMode, job_id: str | None) -> Any:
    """Cases for ``operation``; with ``job_id``, half of them name that job in the path."""
    generated = operation.as_strategy(generation_mode=mode)
    if job_id is None or "{job_id}" not in operation.path:
        return generated
    return st.one_of(
        generated, operation.as_strategy(generation_mode=mode, path_parameters={"job_id": job_id})
    )


def _has_constrained_input(operation: Any) -> bool:
    """A body, a query parameter, a header, or a path parameter besides the free-form job id."""
    free = operation.path.count("{job_id}")
    inputs = len(operation.body) + len(operation.query) + len(operation.headers)
    return inputs > 0 or len(operation.path_parameters) > free


def _run(
    operation: Any,
    mode: GenerationMode,
    examples: int,
    call: Callable[[Any], None],
    job_id: str | None = None,
) -> str | None:
    """Send ``examples`` cases of ``mode`` to ``operation`` through ``call``; the first failure as
    text, else None. Raises NothingToNegate when no negative case exists for the operation."""

    @seed(SEED)
    @given(case=_strategy(operation, mode, job_id))
    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[Phase.explicit, Phase.generate],
    )
    def check(case: Any) -> None:
        call(case)

    try:
        check()
    except Unsatisfiable:
        if mode == GenerationMode.NEGATIVE and not _has_constrained_input(operation):
            raise NothingToNegate(operation.label) from None
        return f"{mode.value} {operation.label} (seed {SEED}): no case could be generated"
    except (Exception, BaseExceptionGroup) as exc:  # any failure is reported, then the next runs
        return f"{mode.value} {operation.label} (seed {SEED}):\n{exc}"
    return None


def _send(case: Any, headers: dict[str, str] | None, checks: list[Any], retried: list[int]) -> Any:
    """Send ``case`` and judge the answer with ``checks``. A 503 ``unavailable`` is the service's
    documented "retry in a few seconds" (etcd slow, or leadership changing hands on a starved
    machine); it is retried up to RETRIES times, counted in ``retried``, and judged if it lasts."""
    for attempt in range(RETRIES + 1):
        response = case.call(headers=headers, timeout=30)
        if response.status_code != 503 or attempt == RETRIES or _code(response) != "unavailable":
            break
        retried[0] += 1
        time.sleep(1.0)
    case.validate_response(response, checks=checks, headers=headers)
    return response


def _code(response: Any) -> str | None:
    try:
        code: str = response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code


def _submit(client: httpx.Client) -> str:
    job = client.post("/v1/jobs", json=SPEC)
    assert job.status_code == 201, job.text
    job_id: str = job.json()["id"]
    return job_id


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_is_on_schema_and_never_a_server_error(
    service: ServiceProcess, operations: list[Any], mode: GenerationMode
) -> None:
    auth = {"Authorization": f"Bearer {service.token}"}
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    sent: dict[str, int] = {}
    retried = [0]

    def call(operation: Any) -> Callable[[Any], None]:
        def send(case: Any) -> None:
            sent[operation.label] = sent.get(operation.label, 0) + 1
            _send(case, auth, checks, retried)

        return send

    failures, unnegatable = [], []
    with memory_bounded(service) as peak, service.client() as client:
        for op in operations:
            job_id = _submit(client)  # a live job of its own for each operation
            try:
                failure = _run(op, mode, EXAMPLES, call(op), job_id)
            except NothingToNegate:
                unnegatable.append(op.label)
                continue
            failures += [failure] if failure else []
    assert not failures, "\n\n".join(failures)
    assert {"POST /v1/jobs", "POST /v1/jobs/{job_id}/workers/checkpoints"} <= set(sent), sent
    assert len(sent) + len(unnegatable) == len(operations)
    assert sum(sent.values()) >= EXAMPLES * len(sent) // 2, sent  # the run really sent requests
    print(
        f"\n{mode.value}: {EXAMPLES} examples per operation, {sum(sent.values())} requests, seed {SEED}, "
        f"service peak {peak[0] >> 20} MiB, {retried[0]} retried 503s; "
        f"no negative case exists for {unnegatable}"
    )


@pytest.mark.parametrize("token", [None, "not-a-token", "worker"], ids=["missing", "wrong", "other-job"])
def test_without_the_right_token_every_v1_route_refuses(
    service: ServiceProcess, operations: list[Any], token: str | None
) -> None:
    """No token or a wrong one: 401. The worker token of job A, on any job but A: 403."""
    expected = (401, "unauthenticated")
    other: str | None = None
    if token == "worker":
        with service.client() as client:
            mine, other = _submit(client), _submit(client)
        wait_for(lambda: f"{mine}-n0-a0" in service.launches(), what="the first node's launch")
        token, expected = service.launch_env(f"{mine}-n0-a0")["ELASTRAIN_WORKER_TOKEN"], (403, "forbidden")

    def call(operation: Any) -> Callable[[Any], None]:
        def send(case: Any) -> None:
            case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
            extra = {"Authorization": f"Bearer {token}"} if token else None
            response = _send(case, extra, CHECKS, [0])
            if operation.path not in PUBLIC:
                assert (response.status_code, response.json()["error"]["code"]) == expected, response.text

        return send

    failures = [
        f for op in operations if (f := _run(op, GenerationMode.POSITIVE, TOKEN_EXAMPLES, call(op), other))
    ]
    assert not failures, "\n\n".join(failures)


def test_the_schema_declares_our_error_model_for_every_error(service: ServiceProcess) -> None:
    schema = httpx.get(f"{service.url}/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            assert ("security" in op) == (path in PUBLIC), f"{method.upper()} {path}: who may call it"
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")):
                    content = response.get("content", {}).get("application/json", {})
                    assert content.get("schema") == {"$ref": "#/components/schemas/ErrorResponse"}, (
                        f"{method.upper()} {path} {status}"
                    )


MARK = "\u0000poison\u0000"


def poisoned(body: dict[str, Any], how: str, token: str, pick: int) -> tuple[bytes, str]:
    """``body`` as JSON text with one number made non-finite (``token``) or one key given twice;
    the bytes and the dotted path of the poisoned field."""
    if how == "duplicate" and body:
        key = sorted(body)[pick % len(body)]
        text = json.dumps(body)
        field = key or "body"  # a key that is the empty string has no name: the body is named
        return ("{" + json.dumps(key) + ": " + json.dumps(body[key]) + ", " + text[1:]).encode(), field
    numbers = list(_numbers(body, ()))
    if numbers:
        path = numbers[pick % len(numbers)]
        target: Any = body
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = MARK
    else:
        path = ("extra",)
        body = body | {"extra": MARK}
    text = json.dumps(body).replace(json.dumps(MARK), token)
    return text.encode(), ".".join(str(p) for p in path) or "body"  # a lone "" key: as above


def _numbers(value: Any, path: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, (*path, index))
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path


def test_non_finite_numbers_and_keys_given_twice_are_refused_in_every_body(
    service: ServiceProcess, operations: list[Any]
) -> None:
    """Over every operation that takes a JSON body: a schema-valid body
    with one number made NaN, Infinity, -Infinity or 1e999, or with one key given twice, is a
    422 ErrorResponse naming that field (Python's json would accept the first, and let the last
    of two keys win)."""
    auth = {"Authorization": f"Bearer {service.token}", "Content-Type": "application/json"}
    with_body = [op for op in operations if op.body]
    sent: dict[str, int] = {}
    assert {"POST /v1/jobs", "POST /v1/jobs/{job_id}/workers/progress"} <= {op.label for op in with_body}
    failures = []
    with service.client() as client, httpx.Client(base_url=service.url, timeout=30) as raw:
        for op in with_body:
            check = _poison_check(op, raw, auth, _submit(client), sent)
            try:
                check()
            except (Exception, BaseExceptionGroup) as exc:
                failures.append(f"{op.label}: {exc}")
    assert not failures, "\n\n".join(failures)
    assert set(sent) == {op.label for op in with_body} and min(sent.values()) >= 10, sent


def _poison_check(
    op: Any, raw: httpx.Client, auth: dict[str, str], job_id: str, sent: dict[str, int]
) -> Callable[[], None]:
    """The hypothesis test of one operation for the test above."""

    @seed(SEED)
    @given(
        case=_strategy(op, GenerationMode.POSITIVE, job_id),
        how=st.sampled_from(["non-finite", "duplicate"]),
        token=st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]),
        pick=st.integers(0, 1000),
    )
    @settings(max_examples=max(10, EXAMPLES // 10), deadline=None, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])  # fmt: skip
    def check(case: Any, how: str, token: str, pick: int) -> None:
        if not isinstance(case.body, dict):
            return
        content, field = poisoned(json.loads(json.dumps(case.body)), how, token, pick)
        resp = raw.post(case.formatted_path, content=content, params=case.query, headers=auth)
        sent[op.label] = sent.get(op.label, 0) + 1
        what = f"{op.label} {how} {field}: {resp.status_code} {resp.text[:300]} (seed {SEED})"
        assert resp.status_code == 422, what
        error = resp.json()["error"]
        assert error["code"] == "invalid_request" and error["field"] == field, what

    return check  # type: ignore[no-any-return]
