"""A checkpoint directory belongs to one job (the service half): a claim the
service records in etcd in the same transaction as the job, and the marker in the directory
(worker.checkpoint.owner). A job whose checkpoint.dir is another job's (or inside it, or holds
it) is refused at submit with 422 naming checkpoint.dir and the fix; starting from it with
checkpoint.resume is read-only and allowed."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.service.api_client import AUTH, SPEC, api

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.objectstore import ObjectStorage
from service.jobs.parts import JobParts
from service.jobs.paths import PathError
from worker.checkpoint.owner import OWNER_FILE, claim, read_owner
from worker.jobspec.spec import parse_spec


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return (tmp_path / "checkpoints").resolve()


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


@pytest.fixture
def client(tmp_path: Path, store: MemoryStore) -> Iterator[TestClient]:
    with api(tmp_path, store) as c:
        yield c


def submit(client: TestClient, checkpoint: dict[str, Any], **headers: str) -> Any:
    return client.post("/v1/jobs", json=SPEC | {"checkpoint": checkpoint}, headers=AUTH | headers)


def test_a_second_job_cannot_take_another_jobs_directory(client: TestClient, root: Path) -> None:
    first = submit(client, {"dir": "shared"})
    assert first.status_code == 201, first.text
    owner = first.json()["id"]
    marker = read_owner(root / "shared")
    assert marker is not None and marker.job == owner  # written at submit
    again = submit(client, {"dir": "shared"})
    assert again.status_code == 422, again.text
    error = again.json()["error"]
    assert error["field"] == "checkpoint.dir"
    assert owner in error["message"] and "checkpoint.resume" in error["message"]
    absolute = submit(client, {"dir": str(root / "shared")})
    assert absolute.status_code == 422 and absolute.json()["error"]["field"] == "checkpoint.dir"


@pytest.mark.parametrize(("first", "second"), [("outer/inner", "outer"), ("outer", "outer/inner/deeper")])
def test_a_directory_inside_or_around_another_jobs_is_refused(
    client: TestClient, first: str, second: str
) -> None:
    """A job writing step-* directories inside another's would be read by its resume; one holding
    another's would see its steps as its own (and retention would judge them)."""
    assert submit(client, {"dir": first}).status_code == 201
    resp = submit(client, {"dir": second})
    assert resp.status_code == 422 and resp.json()["error"]["field"] == "checkpoint.dir", resp.text


def test_another_job_starts_from_it_by_saying_so(client: TestClient, root: Path) -> None:
    owner = submit(client, {"dir": "shared"}).json()["id"]
    follower = submit(client, {"dir": "mine", "resume": str(root / "shared")})
    assert follower.status_code == 201, follower.text
    spec = follower.json()["spec"]["checkpoint"]
    assert spec["resume"] == str(root / "shared") and spec["dir"] == str(root / "mine")
    assert read_owner(root / "shared").job == owner  # type: ignore[union-attr]


def test_a_directory_a_bare_worker_claimed_is_refused(client: TestClient, root: Path) -> None:
    claim(root / "lab-run", "a-torchrun-job")  # the marker a worker under plain torchrun writes
    resp = submit(client, {"dir": "lab-run"})
    assert resp.status_code == 422 and "a-torchrun-job" in resp.json()["error"]["message"], resp.text


def test_the_claim_is_in_etcd_with_the_job(client: TestClient, store: MemoryStore, root: Path) -> None:
    job = submit(client, {"dir": "shared"}).json()
    found = store.get(keys.dir_claim(str(root / "shared")))
    assert found is not None and json.loads(found.value)["job"] == job["id"]
    default = submit(client, {}).json()  # the default <root>/<job id> is claimed too
    assert store.get(keys.dir_claim(default["checkpoint_dir"])) is not None


def test_the_same_idempotency_key_returns_the_same_job_not_a_conflict(client: TestClient) -> None:
    first = submit(client, {"dir": "shared"}, **{"Idempotency-Key": "k1"})
    second = submit(client, {"dir": "shared"}, **{"Idempotency-Key": "k1"})
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]


def test_an_unreadable_marker_refuses_the_directory(client: TestClient, root: Path) -> None:
    (root / "broken").mkdir(parents=True)
    (root / "broken" / OWNER_FILE).write_text("{not json")
    resp = submit(client, {"dir": "broken"})
    assert resp.status_code == 422 and "OWNER.json" in resp.json()["error"]["message"], resp.text


def test_an_s3_prefix_belongs_to_one_job_too(tmp_path: Path, store: MemoryStore) -> None:
    """With object storage (its bucket check left to the integration tests), a job's ``s3://``
    prefix is claimed in etcd: the same prefix, one inside it or one holding it is refused for
    another job naming checkpoint.dir; a sibling prefix or another bucket is free."""
    storage = ObjectStorage(env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}, check_bucket=False)
    parts = JobParts.build(store, storage_root=tmp_path / "ck", secret=b"s" * 32, object_storage=storage)

    def create(location: str) -> str:
        record, _ = parts.records.create(parse_spec(SPEC | {"checkpoint": {"dir": location}}))
        return record.checkpoint_dir

    assert create("s3://ckpt/teams/a/") == "s3://ckpt/teams/a"
    for taken in ("s3://ckpt/teams/a", "s3://ckpt/teams/a/run-2", "s3://ckpt/teams"):
        with pytest.raises(PathError, match=r"checkpoint\.dir.*belongs to job"):
            create(taken)
    assert create("s3://ckpt/teams/b") == "s3://ckpt/teams/b"
    assert create("s3://other/teams/a") == "s3://other/teams/a"
    assert not (tmp_path / "ck").exists()  # nothing was written under the storage root
