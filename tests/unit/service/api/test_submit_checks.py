"""What a submit refuses because it could never run: a 422 naming the field and the fix, at
submit, instead of a failure at launch or in the worker."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.service.api_client import AUTH, SPEC, api

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from service.settings import load_settings

make_client = api


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
    """A malformed resource such as {"cpu": "x"} is refused at submit, not left to fail at launch
    as a failed node."""
    error = refused(client, SPEC | {"resources": resources})
    assert error["field"] == field and words in error["message"], error


def test_resources_a_scheduler_can_use_are_accepted(client: TestClient) -> None:
    resources = {"cpu": "4", "gpu": "1", "memory": "16Gi", "instance_type": "m5.xlarge"}
    resp = client.post("/v1/jobs", json=SPEC | {"resources": resources}, headers=AUTH)
    assert resp.status_code == 201 and resp.json()["spec"]["resources"] == resources


FACTORY_FIELDS = {
    "model.factory": lambda f: {"model": {"factory": f}},
    "data.factory": lambda f: {"data": {"factory": f}},
    "loss.factory": lambda f: {"loss": {"factory": f}},
}


@pytest.mark.parametrize("field", sorted(FACTORY_FIELDS))
def test_with_an_empty_allowlist_only_built_ins_run(tmp_path: Path, field: str) -> None:
    """Holding the API token must not mean running any importable code on the workers ('torch.hub:load'
    with source 'local' would run a hubconf.py). ELASTRAIN_FACTORY_ALLOWLIST='' (the chart's
    default) allows the built-ins only."""
    with make_client(tmp_path, factory_allowlist="") as client:
        error = refused(client, SPEC | FACTORY_FIELDS[field]("torch.hub:load"))
        assert error["field"] == field, error
        assert "ELASTRAIN_FACTORY_ALLOWLIST" in error["message"] and "built-in" in error["message"]
        assert client.post("/v1/jobs", json=SPEC, headers=AUTH).status_code == 201


@pytest.mark.parametrize(
    ("factory", "allowed"),
    [
        ("team_a.models:build", True),
        ("team_a:build", True),
        ("team_b.vision.resnet:make", True),
        ("team_b.other:make", False),
        ("team_ab.models:build", False),  # a prefix is a whole module name, not a string prefix
        ("torch.hub:load", False),
        ("os:system", False),
    ],
)
def test_an_allowlist_names_module_prefixes(tmp_path: Path, factory: str, allowed: bool) -> None:
    with make_client(tmp_path, factory_allowlist="team_a, team_b.vision") as client:
        for field, build in FACTORY_FIELDS.items():
            resp = client.post("/v1/jobs", json=SPEC | build(factory), headers=AUTH)
            assert resp.status_code == (201 if allowed else 422), (field, resp.text)
            if not allowed:
                assert resp.json()["error"]["field"] == field


def test_without_an_allowlist_any_factory_is_taken(client: TestClient) -> None:
    """Unset (one machine, the default): the service trusts whoever holds the API token."""
    resp = client.post("/v1/jobs", json=SPEC | {"model": {"factory": "team_x.models:build"}}, headers=AUTH)
    assert resp.status_code == 201, resp.text


@pytest.mark.parametrize("value", ["team-a", "team a", ".team", "team..a", "team.", "a:b"])
def test_an_allowlist_entry_must_be_a_module_name(tmp_path: Path, value: str) -> None:
    from service.settings import SettingsError

    with pytest.raises(SettingsError, match="ELASTRAIN_FACTORY_ALLOWLIST"):
        load_settings(data_dir=tmp_path, factory_allowlist=value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_steps": 10**30}, "max_steps"),
        ({"max_steps": 10**9 + 1}, "max_steps"),
        ({"micro_batch_size": 10**12}, "micro_batch_size"),
        ({"grad_accum_steps": 10**6}, "grad_accum_steps"),
        ({"global_batch_size": 2**40, "micro_batch_size": 8}, "global_batch_size"),
        ({"data": {"name": "synthetic", "samples": 10**12}}, "data.samples"),
        ({"data": {"name": "synthetic", "eval_samples": 10**12}}, "data.eval_samples"),
        ({"optimizer": {"lr": 1e300}}, "optimizer.lr"),
        ({"optimizer": {"betas": [0.9, 1.5]}}, "optimizer.betas.1"),
        ({"loss_scale": {"init_scale": 1e300}}, "loss_scale.init_scale"),
        (
            {"checkpoint": {"retention": {"pinned_steps": list(range(2000))}}},
            "checkpoint.retention.pinned_steps",
        ),
        ({"model": {"name": "mlp", "kwargs": {f"k{i}": 1 for i in range(100)}}}, "model.kwargs"),
        ({"model": {"name": "mlp", "kwargs": {"note": "x" * 5000}}}, "model.kwargs.note"),
        ({"log_every_steps": 10**12}, "log_every_steps"),
    ],
)
def test_sizes_no_run_can_use_are_refused_at_submit(
    client: TestClient, change: dict[str, Any], field: str
) -> None:
    """Sizes past what a run can do at all (max_steps 1e30, micro_batch_size 1e12) are refused."""
    error = refused(client, SPEC | change)
    assert error["field"] == field, error
    assert field in error["message"]


def test_the_largest_sizes_the_spec_allows_are_accepted(client: TestClient) -> None:
    spec = SPEC | {
        "max_steps": 10**9,
        "micro_batch_size": 2**20,
        "data": {"name": "synthetic", "samples": 10**10},
    }
    assert client.post("/v1/jobs", json=spec, headers=AUTH).status_code == 201


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"env": {"ELASTRAIN_WORKER_TOKEN": "x"}}, "env"),
        ({"env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}}, "env"),
        ({"env": {"TORCHELASTIC_RUN_ID": "x"}}, "env"),
        ({"env": {"torch_home": "/x"}}, "env"),
        ({"env": {"MASTER_ADDR": "evil"}}, "env"),
        ({"env": {"RANK": "0"}}, "env"),
        ({"env": {"PET_NNODES": "9"}}, "env"),
        ({"env": {"1BAD": "x"}}, "env"),
        ({"env": {"A-B": "x"}}, "env"),
        ({"env": {f"V{i}": "x" for i in range(65)}}, "env"),
        ({"env": {"BIG": "x" * 5000}}, "env.BIG"),
        ({"image": "Not An Image"}, "image"),
        ({"image": "x" * 300}, "image"),
    ],
)
def test_a_jobs_env_and_image_are_checked_at_submit(
    client: TestClient, change: dict[str, Any], field: str
) -> None:
    """``env`` is a bounded map, names checked, nothing the service or torchrun sets."""
    error = refused(client, SPEC | change)
    assert error["field"] == field, error


def test_a_jobs_image_and_env_are_stored_with_it(client: TestClient) -> None:
    team = {"image": "registry.example.com/team/worker:1.2@sha256:" + "a" * 64,
            "env": {"PYTHONPATH": "/opt/team", "HF_HOME": "/tmp/hf", "NCCL_DEBUG": "WARN"}}  # fmt: skip
    resp = client.post("/v1/jobs", json=SPEC | team, headers=AUTH)
    assert resp.status_code == 201, resp.text
    assert {k: resp.json()["spec"][k] for k in team} == team
