"""What every request body must be before any route reads it: JSON
numbers are finite, each key appears once per object, integers have a sane number of digits,
nesting is shallow. Each refusal is a 422 that names the field, on every route."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.service.api_client import AUTH as BASE_AUTH
from tests.unit.service.api_client import SPEC, api

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from worker.errors import SpecError
from worker.jobspec.spec import parse_spec

AUTH = BASE_AUTH | {"Content-Type": "application/json"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with api(tmp_path) as c:
        yield c


def spec_text(**fields: str) -> bytes:
    """The spec's JSON with ``fields`` spliced in as raw JSON text (what json.dumps cannot write)."""
    text = json.dumps({k: v for k, v in SPEC.items() if k not in fields})[:-1]
    for name, raw in fields.items():
        text += f', "{name}": {raw}'
    return (text + "}").encode()


NON_FINITE = ["Infinity", "-Infinity", "NaN", "1e999", "-1e999"]


@pytest.mark.parametrize("token", NON_FINITE)
@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("optimizer", '{"lr": %s}'),
        ("optimizer", '{"betas": [0.9, %s]}'),
        ("optimizer", '{"grad_clip_norm": %s}'),
        ("loss_scale", '{"init_scale": %s}'),
        ("ddp", '{"bucket_cap_mb": %s}'),
        ("model", '{"name": "mlp", "kwargs": {"dropout": %s}}'),
    ],
)
def test_a_non_finite_number_in_a_spec_is_422_naming_the_field(
    client: TestClient, token: str, field: str, raw: str
) -> None:
    """A non-finite number is refused: ``"lr": Infinity`` stored as null would fail every
    reconciler pass from then on."""
    body = spec_text(**{field: raw % token})
    resp = client.post("/v1/jobs", content=body, headers=AUTH)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    expected = {
        '{"lr": %s}': "optimizer.lr",
        '{"betas": [0.9, %s]}': "optimizer.betas.1",
        '{"grad_clip_norm": %s}': "optimizer.grad_clip_norm",
        '{"init_scale": %s}': "loss_scale.init_scale",
        '{"bucket_cap_mb": %s}': "ddp.bucket_cap_mb",
        '{"name": "mlp", "kwargs": {"dropout": %s}}': "model.kwargs.dropout",
    }[raw]
    assert error["field"] == expected and expected in error["message"]
    assert "finite" in error["message"]
    assert client.get("/v1/jobs", headers=AUTH).json()["jobs"] == []


@pytest.mark.parametrize("token", NON_FINITE)
def test_a_non_finite_number_in_a_worker_body_is_422(client: TestClient, token: str) -> None:
    job = client.post("/v1/jobs", json=SPEC, headers=AUTH).json()
    base = f"/v1/jobs/{job['id']}/workers"
    progress = f'{{"step": 3, "loss": {token}}}'.encode()
    resp = client.post(f"{base}/progress", content=progress, headers=AUTH)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "loss", resp.text
    report = {"step": 4, "generation": 0, "rank": 0, "world_size": 1, "ok": False, "error": "x"}
    text = json.dumps(report)[:-1] + f', "context": {{"metrics": {{"loss": {token}}}}}}}'
    resp = client.post(f"{base}/checkpoints", content=text.encode(), headers=AUTH)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "context.metrics.loss", resp.text


@pytest.mark.parametrize("token", NON_FINITE)
def test_the_spec_refuses_non_finite_numbers_for_the_worker_too(token: str) -> None:
    """The worker reads the same schema from a file: it refuses them (exit 2), naming the field."""
    with pytest.raises(SpecError, match=r"optimizer\.lr.*finite"):
        parse_spec(spec_text(optimizer=f'{{"lr": {token}}}'))
    with pytest.raises(SpecError, match=r"optimizer\.lr.*finite"):
        parse_spec(SPEC | {"optimizer": {"lr": float(token)}})


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 65 + b"1" + b"}" * 65,
        b'{"name": "[[[[' + b"[" * 100 + b'"}',
    ],
)
def test_nesting_is_counted_outside_strings(client: TestClient, body: bytes) -> None:
    resp = client.post("/v1/jobs", content=body, headers=AUTH)
    if body.startswith(b'{"name"'):  # brackets inside a string do not nest: an invalid spec
        assert resp.status_code == 422 and resp.json()["error"]["code"] == "invalid_spec", resp.text
    else:
        assert resp.status_code == 422 and resp.json()["error"]["code"] == "too_deep", resp.text


def test_a_body_that_is_not_json_is_left_to_its_route(client: TestClient) -> None:
    for body in (b"{not json", b"\xff\xfe{}", b"[1, 2"):
        resp = client.post("/v1/jobs", content=body, headers=AUTH)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "malformed_json", resp.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (b'{"name": "a", "name": "b"}', "name"),
        (spec_text(optimizer='{"lr": 0.1, "lr": 0.2}'), "optimizer.lr"),
        (spec_text(model='{"name": "mlp", "kwargs": {"d": 1, "e": 2, "d": 3}}'), "model.kwargs.d"),
        (spec_text(max_steps="10", micro_batch_size="4")[:-1] + b', "max_steps": 11}', "max_steps"),
    ],
)
def test_a_key_given_twice_is_422_naming_it(client: TestClient, body: bytes, field: str) -> None:
    """A key given twice is refused rather than letting the last of the two win silently."""
    resp = client.post("/v1/jobs", content=body, headers=AUTH)
    assert resp.status_code == 422, resp.text
    error = resp.json()["error"]
    assert error["field"] == field and "more than once" in error["message"]


def test_a_key_given_twice_in_a_worker_body_is_422(client: TestClient) -> None:
    job = client.post("/v1/jobs", json=SPEC, headers=AUTH).json()
    body = b'{"step": 3, "step": 900}'
    resp = client.post(f"/v1/jobs/{job['id']}/workers/progress", content=body, headers=AUTH)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "step", resp.text
    resp = client.post(f"/v1/jobs/{job['id']}/scale", content=b'{"nodes": 1, "nodes": 1}', headers=AUTH)
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "nodes", resp.text


@pytest.mark.parametrize("where", ["max_steps", "seed", "scale"])
def test_an_integer_of_thousands_of_digits_gets_a_message_for_the_client(
    client: TestClient, where: str
) -> None:
    """An integer with thousands of digits is a 422 naming the field, not Python's advice to use
    sys.set_int_max_str_digits()."""
    digits = "9" * 5000
    if where == "scale":
        job = client.post("/v1/jobs", json=SPEC, headers=AUTH).json()
        body = f'{{"nodes": {digits}}}'.encode()
        resp = client.post(f"/v1/jobs/{job['id']}/scale", content=body, headers=AUTH)
    else:
        resp = client.post("/v1/jobs", content=spec_text(**{where: digits}), headers=AUTH)
    assert resp.status_code == 422, resp.text
    message = resp.json()["error"]["message"]
    assert "digits" in message and "sys." not in message and "set_int_max_str_digits" not in message
