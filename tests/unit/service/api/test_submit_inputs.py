"""Every input is checked before anything is stored: a refused submit is a 422 naming the field,
with nothing in the store and nothing under the storage root; a create whose follow-up fails
takes its record back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.parts import JobParts
from tests.unit.service.api_client import AUTH, SPEC, api
from worker.errors import SpecError
from worker.jobspec.paths import MAX_PATH_DEPTH, check_local_path, check_resume
from worker.jobspec.spec import parse_spec

DEEP = "a/" * 1500
_RESUME_FIX = "give 'auto'"
_URL_FIX = "is not supported; give a local directory or s3://BUCKET/PREFIX"
_S3_UNDER_SERVICE = "this service has no object storage credentials; set AWS_ACCESS_KEY_ID"


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"checkpoint": {"dir": DEEP}}, "checkpoint.dir", f"at most {MAX_PATH_DEPTH} directories"),
        ({"checkpoint": {"dir": "x" * 300}}, "checkpoint.dir", "more than 255 bytes"),
        ({"checkpoint": {"dir": "d/" * 60 + "é" * 2000}}, "checkpoint.dir", "at most 4095 bytes"),
        ({"checkpoint": {"resume": DEEP}}, "checkpoint.resume", "directories"),
        ({"checkpoint": {"dir": "s3://ckpt/runs/a"}}, "checkpoint.dir", _S3_UNDER_SERVICE),
        ({"checkpoint": {"dir": "gs://b/p"}}, "checkpoint.dir", _URL_FIX),
        ({"checkpoint": {"dir": "file:///tmp/x"}}, "checkpoint.dir", _URL_FIX),
        (
            {"checkpoint": {"resume": "s3://ckpt/runs/a/step-00000010"}},
            "checkpoint.resume",
            _S3_UNDER_SERVICE,
        ),
        ({"checkpoint": {"resume": "none"}}, "checkpoint.resume", _RESUME_FIX),
        ({"checkpoint": {"resume": "latest"}}, "checkpoint.resume", _RESUME_FIX),
        ({"checkpoint": {"resume": "12"}}, "checkpoint.resume", _RESUME_FIX),
        ({"checkpoint": {"resume": "Auto"}}, "checkpoint.resume", _RESUME_FIX),
        ({"env": {"A": "x\u0000y"}}, "env", "NUL byte"),
        ({"nodes": "\u0663"}, "nodes", "digits 0-9"),
        ({"nodes": "1:\u0663"}, "nodes", "digits 0-9"),
        ({"resources": {"cpu": "\u0663"}}, "resources.cpu", "whole number"),
        ({"resources": {"memory": "\u0663Gi"}}, "resources.memory", "not a size"),
    ],
)
def test_a_refused_submit_stores_nothing(
    tmp_path: Path, change: dict[str, Any], field: str, words: str
) -> None:
    store = MemoryStore()
    with api(tmp_path / "data", store, storage_root=tmp_path / "ckpt") as client:
        before = {e.key for e in store.list_prefix(keys.ROOT)}
        body = json.dumps(SPEC | change).encode()  # escaped: a lone surrogate travels as \ud800
        resp = client.post("/v1/jobs", content=body, headers=AUTH)
        assert resp.status_code == 422, resp.text
        error = resp.json()["error"]
        assert error["field"] == field and f"field '{field}'" in error["message"], error
        assert words in error["message"], error
        assert {e.key for e in store.list_prefix(keys.ROOT)} == before  # the worker secret alone
        assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


def test_a_bare_worker_reads_the_same_rules() -> None:
    assert parse_spec(SPEC | {"checkpoint": {"dir": "s3://ckpt/runs/a"}}).checkpoint.dir == "s3://ckpt/runs/a"
    with pytest.raises(SpecError, match=r"field 'checkpoint.dir': .*gs:// is not supported; give a local"):
        parse_spec(SPEC | {"checkpoint": {"dir": "gs://ckpt/runs/a"}})
    with pytest.raises(SpecError, match=r"field 'data.path': .*only local paths"):
        parse_spec(
            SPEC | {"data": {"name": "token-file", "path": "s3://b/t.bin", "dtype": "uint16", "seq_len": 4}}
        )


def test_an_env_value_a_process_cannot_hold_is_refused() -> None:
    with pytest.raises(SpecError, match=r"field 'env': the value of 'A' holds a NUL byte"):
        parse_spec(SPEC | {"env": {"A": "a\u0000b"}})
    with pytest.raises(SpecError, match=r"field 'env.A': .*unicode"):  # no bytes for a lone surrogate
        parse_spec(SPEC | {"env": {"A": "\ud800"}})
    assert parse_spec(SPEC | {"env": {"A": "caf\u00e9 \U0001f600"}}).env == {"A": "caf\u00e9 \U0001f600"}


def test_what_a_path_and_resume_may_be() -> None:
    assert check_local_path("runs/a") == "runs/a"
    assert check_local_path("/" + "d/" * MAX_PATH_DEPTH) == "/" + "d/" * MAX_PATH_DEPTH
    assert check_local_path("s3:/not-a-url") == "s3:/not-a-url"  # a local name with a colon
    for keyword in ("auto", "never"):
        assert check_resume(keyword) == keyword
    for path in ("step-00000012", "prev-run", "/shared/ckpt/job-1"):
        assert check_resume(path) == path
    for bad in ("", "  ", "NEVER", "off", "007"):
        with pytest.raises(ValueError):
            check_resume(bad)


def test_resume_step_of_the_jobs_own_directory_is_resolved_there(tmp_path: Path) -> None:
    with api(tmp_path / "data", storage_root=tmp_path / "ckpt") as client:
        resp = client.post("/v1/jobs", json=SPEC | {"checkpoint": {"resume": "step-00000012"}}, headers=AUTH)
        assert resp.status_code == 201, resp.text
        job = resp.json()
        resume = job["spec"]["checkpoint"]["resume"]
        assert resume == str((tmp_path / "ckpt").resolve() / job["id"] / "step-00000012")


def test_a_create_whose_follow_up_fails_takes_its_record_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MemoryStore()
    jobs = JobParts.build(store, storage_root=tmp_path, secret=b"s" * 32).records

    def fails(directory: Path, job_id: str) -> None:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(jobs, "_mark", fails)
    with pytest.raises(RecursionError):
        jobs.create(parse_spec(SPEC), idempotency_key="k1")
    assert store.list_prefix(keys.ROOT) == []
    monkeypatch.undo()
    record, created = jobs.create(parse_spec(SPEC), idempotency_key="k1")  # the key is free again
    assert created and [e.key for e in store.list_prefix(keys.job(""))] == [keys.job(record.id)]
