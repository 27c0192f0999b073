"""Schemathesis over the service's OpenAPI schema (real uvicorn, real etcd): whatever the
generated requests hold, the answer is never a 5xx and always matches the schema.

Every operation is driven with positive data (valid per the schema) and negative data (each
case breaks the schema somewhere: a wrong type, a missing field, an unknown field, an
out-of-range number) with the API token, plus a few cases with no token or a wrong one.
Schemathesis's own checks judge each response: ``not_a_server_error``,
``status_code_conformance`` (the status is one the operation declares),
``content_type_conformance``, ``response_schema_conformance`` (the body matches the declared
schema, our error model included) and ``response_headers_conformance``; negative cases also
get ``negative_data_rejection`` (invalid input is answered 4xx, never 2xx).

Examples per operation and mode: ``ELASTRAIN_SCHEMATHESIS_EXAMPLES`` (default 60, which keeps
this file near two minutes on 2 shared cores; ``make faults`` runs it with 300). The seed is
``ELASTRAIN_SCHEMATHESIS_SEED`` (random by default); every failure report names it. Shrinking
is off to bound the runtime; each failure carries a curl line that reproduces it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
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
from svc_process import ServiceProcess

from service.etcd_server import EtcdServer

pytestmark = pytest.mark.integration

EXAMPLES = int(os.environ.get("ELASTRAIN_SCHEMATHESIS_EXAMPLES", "60"))
SEED = int(os.environ.get("ELASTRAIN_SCHEMATHESIS_SEED", str(random.randrange(2**32))))
UNAUTHENTICATED_EXAMPLES = 5
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]
PUBLIC = {"/healthz", "/readyz", "/metrics"}
SPEC: dict[str, Any] = {
    "name": "fuzzed",
    "model": {"name": "mlp"},
    "data": {"name": "synthetic"},
    "micro_batch_size": 8,
    "max_steps": 20,
    "nodes": "1:3",
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    workdir = tmp_path_factory.mktemp("schemathesis")
    with EtcdServer(workdir / "etcd") as etcd:
        svc = ServiceProcess(workdir, etcd=etcd.endpoint).start()
        try:
            yield svc
        finally:
            svc.stop()


@pytest.fixture(scope="module")
def operations(service: ServiceProcess) -> list[Any]:
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    # The token is ours to send (or to leave out); schemathesis generates no Authorization header.
    schema.config.generation.update(with_security_parameters=False)
    return [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]  # an invalid schema raises here


def _strategy(operation: Any, mode: GenerationMode, job_id: str | None) -> Any:
    """Cases for ``operation``; with ``job_id``, half of them name that (real) job in the path,
    so that the routes get past 404 into the job's state machine and the coordinator."""
    generated = operation.as_strategy(generation_mode=mode)
    if job_id is None or "{job_id}" not in operation.path:
        return generated
    return st.one_of(
        generated, operation.as_strategy(generation_mode=mode, path_parameters={"job_id": job_id})
    )


class NothingToNegate(Exception):
    """Every input of the operation is a free string (or there is none): no case can break it."""


def _run(
    operation: Any,
    mode: GenerationMode,
    examples: int,
    call: Callable[[Any], None],
    job_id: str | None = None,
) -> str | None:
    """Drive ``operation`` with ``examples`` cases of ``mode``; the first failure as text, else None.
    Raises NothingToNegate when no negative case exists for it."""

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
    except Exception as exc:  # a failure of any kind is reported, then the next operation runs
        return f"{mode.value} {operation.label} (seed {SEED}):\n{exc}"
    return None


def _has_constrained_input(operation: Any) -> bool:
    """A body, a query parameter, a header, or a path parameter besides the free-form job id."""
    free = operation.path.count("{job_id}")
    return bool(len(operation.body) or len(operation.query) or len(operation.headers)) or (
        len(operation.path_parameters) > free
    )


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_is_on_schema_and_never_a_server_error(
    service: ServiceProcess, operations: list[Any], mode: GenerationMode
) -> None:
    auth = {"Authorization": f"Bearer {service.token}"}
    checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])
    sent: dict[str, int] = {}

    def call(operation: Any) -> Callable[[Any], None]:
        def send(case: Any) -> None:
            sent[operation.label] = sent.get(operation.label, 0) + 1
            case.call_and_validate(headers=auth, checks=checks)

        return send

    failures, unnegatable = [], []
    with service.client() as client:
        for op in operations:
            job = client.post("/v1/jobs", json=SPEC)  # a live job of its own for each operation
            assert job.status_code == 201, job.text
            try:
                failure = _run(op, mode, EXAMPLES, call(op), job.json()["id"])
            except NothingToNegate:
                unnegatable.append(op.label)
                continue
            failures += [failure] if failure else []
    assert not failures, "\n\n".join(failures)
    assert {"POST /v1/jobs", "POST /v1/jobs/{job_id}/workers/checkpoints"} <= set(sent), sent
    assert "GET /v1/jobs/{job_id}/resume" in sent
    assert sum(sent.values()) >= EXAMPLES * len(sent) // 2, sent  # the run really sent requests
    print(f"{mode.value}: {sum(sent.values())} requests, seed {SEED}; nothing to negate in {unnegatable}")


@pytest.mark.parametrize("token", [None, "not-a-token"], ids=["missing", "wrong"])
def test_without_a_valid_token_every_v1_route_answers_401(
    service: ServiceProcess, operations: list[Any], token: str | None
) -> None:
    def call(operation: Any) -> Callable[[Any], None]:
        def send(case: Any) -> None:
            headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
            case.headers = headers
            extra = {"Authorization": f"Bearer {token}"} if token else None
            response = case.call_and_validate(headers=extra, checks=CHECKS)
            if operation.path not in PUBLIC:
                assert response.status_code == 401, response.text[:300]
                assert response.json()["error"]["code"] == "unauthenticated"

        return send

    modes = [GenerationMode.POSITIVE]
    failures = [
        f for op in operations for mode in modes if (f := _run(op, mode, UNAUTHENTICATED_EXAMPLES, call(op)))
    ]
    assert not failures, "\n\n".join(failures)


def test_the_schema_declares_our_error_model_for_every_error(service: ServiceProcess) -> None:
    schema = httpx.get(f"{service.url}/openapi.json").json()
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, methods in schema["paths"].items():
        for method, op in methods.items():
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")):
                    content = response.get("content", {}).get("application/json", {})
                    assert content.get("schema") == {"$ref": "#/components/schemas/ErrorResponse"}, (
                        f"{method.upper()} {path} {status}"
                    )
