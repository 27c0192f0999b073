"""What a submit refuses because it could never run (issue 13 items 7, 8, 10; issue 12 item 6):
a 422 naming the field and the fix, at submit, instead of a failure at launch or in the worker."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from service.api.app import create_app
from service.etcd.memory import MemoryStore
from service.settings import load_settings

TOKEN = "t" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SPEC: dict[str, Any] = {
    "name": "demo",
    "model": {"name": "mlp"},
    "data": {"name": "synthetic"},
    "micro_batch_size": 8,
    "max_steps": 20,
}


def make_client(tmp_path: Path, **settings: Any) -> TestClient:
    app = create_app(load_settings(data_dir=tmp_path, **settings), MemoryStore(), api_token=TOKEN)
    return TestClient(app, raise_server_exceptions=False)


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with make_client(tmp_path) as c:
        yield c


def refused(client: TestClient, spec: dict[str, Any]) -> dict[str, Any]:
    resp = client.post("/v1/jobs", json=spec, headers=AUTH)
    assert resp.status_code == 422, resp.text
    error: dict[str, Any] = resp.json()["error"]
    return error


@pytest.mark.parametrize(
    ("resources", "field", "words"),
    [
        ({"cpu": "x"}, "resources.cpu", "whole number"),
        ({"gpu": "-1"}, "resources.gpu", "0 or more"),
        ({"memory": "lots"}, "resources.memory", "size like"),
        ({"cores": "4"}, "resources", "unknown key"),
        ({"memory": "1Gi", "memMB": "10"}, "resources", "not both"),
    ],
)
def test_resources_that_no_scheduler_can_use_are_refused_at_submit(
    client: TestClient, resources: dict[str, str], field: str, words: str
) -> None:
    """Issue 13 item 8: {"cpu": "x"} was accepted and failed only at launch, as a failed node."""
    error = refused(client, SPEC | {"resources": resources})
    assert error["field"] == field and words in error["message"], error


def test_resources_a_scheduler_can_use_are_accepted(client: TestClient) -> None:
    resources = {"cpu": "4", "gpu": "1", "memory": "16Gi", "instance_type": "m5.xlarge"}
    resp = client.post("/v1/jobs", json=SPEC | {"resources": resources}, headers=AUTH)
    assert resp.status_code == 201 and resp.json()["spec"]["resources"] == resources
