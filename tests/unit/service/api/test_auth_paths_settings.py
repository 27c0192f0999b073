"""Pure decisions: who may call what, where checkpoints may live, which settings are refused,
and how domain errors become HTTP errors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from service.api.auth import authorize, bearer
from service.api.errors import from_domain, from_validation
from service.jobs.errors import ConflictError, NotFoundError
from service.jobs.machine import IllegalTransitionError
from service.jobs.objectstore import ObjectStorage
from service.jobs.paths import PathError, checkpoint_dir, contained, resume_source
from service.jobs.tokens import derive_worker_token, hash_token, worker_token_job
from service.launch.environment import launch_storage_env
from service.settings import Settings, SettingsError, load_settings
from worker.checkpoint.storage import StorageError
from worker.errors import SpecError
from worker.etcdclient import EtcdUnavailableError
from worker.jobspec.location import S3Location

SECRET = b"s" * 32
API = "a" * 32


def decide(
    token: str | None, *, job: str | None = "job-a", worker_route: bool = True
) -> tuple[int, str | None]:
    d = authorize(token, api_token_hash=hash_token(API), secret=SECRET, job_id=job, worker_route=worker_route)
    return d.status, d.principal


def test_api_token_passes_everywhere() -> None:
    assert decide(API, worker_route=False) == (200, "api")
    assert decide(API, worker_route=True) == (200, "api")


def test_missing_and_wrong_tokens_are_401() -> None:
    assert decide(None) == (401, None)
    assert decide("nope") == (401, None)
    assert decide(API + "x") == (401, None)
    forged = derive_worker_token(b"other secret", "job-a")
    assert decide(forged) == (401, None)


def test_worker_token_reaches_only_its_own_jobs_callbacks() -> None:
    token = derive_worker_token(SECRET, "job-a")
    assert decide(token) == (200, "worker")
    assert decide(token, job="job-b") == (403, None)
    assert decide(token, worker_route=False) == (403, None)


def test_worker_token_names_its_job() -> None:
    token = derive_worker_token(SECRET, "job-a")
    assert worker_token_job(SECRET, token) == "job-a"
    assert worker_token_job(SECRET, token[:-1] + "0") in (None, "job-a")  # last hex digit flipped
    assert worker_token_job(SECRET, "ewk.job-a") is None


@pytest.mark.parametrize(
    ("header", "token"),
    [("Bearer abc", "abc"), ("bearer  abc ", "abc"), ("Basic abc", None), ("Bearer", None), (None, None)],
)
def test_bearer_header(header: str | None, token: str | None) -> None:
    assert bearer(header) == token


# ---------------------------------------------------------------- paths


def test_default_checkpoint_dir_is_root_slash_job(tmp_path: Path) -> None:
    assert checkpoint_dir(None, root=tmp_path, job_id="j-1") == tmp_path.resolve() / "j-1"


def test_relative_and_absolute_dirs_inside_the_root_are_accepted(tmp_path: Path) -> None:
    assert checkpoint_dir("team/run", root=tmp_path, job_id="j") == tmp_path.resolve() / "team/run"
    inside = str(tmp_path / "x")
    assert checkpoint_dir(inside, root=tmp_path, job_id="j") == tmp_path.resolve() / "x"


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ("../escape", "contains '..'"),
        ("a/../../b", "contains '..'"),
        ("/etc", "outside the storage root"),
        ("a\x00b", "NUL"),
        ("", "empty"),
        (".", "outside the storage root"),
        ("s3://ckpt/runs/a", "no object storage credentials; set AWS_ACCESS_KEY_ID"),
    ],
)
def test_escapes_are_refused_with_the_field_named(tmp_path: Path, given: str, match: str) -> None:
    with pytest.raises(PathError, match=match) as info:
        checkpoint_dir(given, root=tmp_path, job_id="j")
    assert info.value.field == "checkpoint.dir"
    assert str(info.value).startswith("field 'checkpoint.dir'")


def test_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(tmp_path, root / "link")
    with pytest.raises(PathError, match="through a symlink"):
        contained("link/elsewhere", root=root, field="checkpoint.dir")


def test_resume_keywords_pass_and_paths_are_contained(tmp_path: Path) -> None:
    job_dir = tmp_path / "j"
    for word in ("auto", "never"):
        assert resume_source(word, root=tmp_path, job_dir=job_dir) == word
    step = resume_source("step-00000012", root=tmp_path, job_dir=job_dir)
    assert step == str(tmp_path.resolve() / "j/step-00000012")  # a step of the job's own
    assert resume_source("step-x", root=tmp_path, job_dir=job_dir) == str(tmp_path.resolve() / "j/step-x")
    with pytest.raises(PathError, match=r"checkpoint\.resume"):
        resume_source("/tmp/../etc", root=tmp_path, job_dir=job_dir)
    with pytest.raises(PathError, match=r"checkpoint\.resume"):
        resume_source("s3://ckpt/runs/a", root=tmp_path, job_dir=job_dir)


# ---------------------------------------------------------------- settings


def test_defaults_are_embedded_local(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ELASTRAIN_API_TOKEN", raising=False)
    settings = load_settings(data_dir=tmp_path)
    assert settings.embedded_etcd and settings.scheduler == "local_cwd"
    assert settings.checkpoint_root == tmp_path / "checkpoints"
    assert settings.service_url == "http://127.0.0.1:8080"


def test_environment_names_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTRAIN_ETCD", "http://e1:2379,http://e2:2379")
    monkeypatch.setenv("ELASTRAIN_PORT", "9000")
    monkeypatch.setenv("ELASTRAIN_HOST", "0.0.0.0")
    settings = load_settings()
    assert settings.etcd_endpoints == ["http://e1:2379", "http://e2:2379"]
    assert settings.service_url == "http://127.0.0.1:9000"


def test_a_worker_port_is_what_nodes_are_told_and_the_api_keeps_its_own() -> None:
    settings = load_settings(host="0.0.0.0", port=9000, worker_port=9001)
    assert settings.service_url == "http://127.0.0.1:9001"  # what a launched node calls
    assert settings.worker_listen_url == "http://0.0.0.0:9001"
    assert settings.instance_address == "http://127.0.0.1:9000"  # a standby forwards to the API
    advertised = load_settings(port=9000, worker_port=9001, advertise_url="http://svc:9001")
    assert (
        advertised.service_url == "http://svc:9001" and advertised.instance_address == "http://127.0.0.1:9000"
    )
    plain = load_settings(port=9000, advertise_url="http://svc:9000")
    assert plain.worker_listen_url is None and plain.instance_address == "http://svc:9000"
    assert load_settings(host="::1", port=9000, worker_port=9001).service_url == "http://[::1]:9001"
    assert (
        settings.instance_workers_address == "http://127.0.0.1:9001"
        and plain.instance_workers_address is None
    )
    pod = load_settings(port=9000, worker_port=9001, instance_url="http://10.1.2.3:9000")
    assert pod.instance_workers_address == "http://10.1.2.3:9001"  # a standby forwards callbacks there
    from service.server import serving_line

    line = serving_line(settings)
    assert "workers' calls on http://0.0.0.0:9001" in line
    assert "workers reach it at http://127.0.0.1:9001" in line


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"port": 70000}, "ELASTRAIN_PORT"),
        ({"etcd": "localhost:2379"}, "http://HOST:PORT"),
        ({"scheduler": "slurm"}, "ELASTRAIN_SCHEDULER"),
        ({"scheduler": "kubernetes", "etcd": "http://e:2379"}, "ELASTRAIN_WORKER_IMAGE"),
        ({"scheduler": "kubernetes", "worker_image": "img"}, "ELASTRAIN_ETCD"),
        ({"api_token": "short"}, "at least 16"),
        ({"max_body_bytes": 10}, "ELASTRAIN_MAX_BODY_BYTES"),
        ({"checkpoint_mount": "rel"}, "absolute"),
        ({"worker_port": 8080}, "ELASTRAIN_WORKER_PORT 8080 is also ELASTRAIN_PORT"),
        ({"worker_port": 0}, "ELASTRAIN_WORKER_PORT"),
    ],
)
def test_nonsense_is_refused_with_the_name(overrides: dict[str, object], match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        load_settings(**overrides)


# ---------------------------------------------------------------- error mapping


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (SpecError("field 'max_steps': Input should be greater than 0"), 422, "invalid_spec"),
        (PathError("checkpoint.dir", "bad"), 422, "invalid_path"),
        (NotFoundError("no job"), 404, "not_found"),
        (ConflictError("reused key"), 409, "conflict"),
        (IllegalTransitionError("done", code="job_finished"), 409, "job_finished"),
        (IllegalTransitionError("range", code="out_of_range"), 422, "out_of_range"),
        (EtcdUnavailableError("etcd down"), 503, "unavailable"),
        (StorageError("s3://ckpt: connection refused"), 503, "storage_unavailable"),
    ],
)
def test_domain_errors_map_to_4xx_or_503(exc: Exception, status: int, code: str) -> None:
    err = from_domain(exc)  # type: ignore[arg-type]
    assert (err.status, err.code) == (status, code)


def test_spec_error_names_its_field() -> None:
    assert from_domain(SpecError("field 'data.samples': too small")).field == "data.samples"


def test_validation_errors_name_fields_and_malformed_json_is_400() -> None:
    err = from_validation(
        [{"type": "int_type", "loc": ("body", "nodes"), "msg": "Input should be a valid integer"}]
    )
    assert (err.status, err.field) == (422, "nodes")
    assert "whole number" in err.message
    assert from_validation([{"type": "json_invalid", "loc": ("body", 1), "msg": "x"}]).status == 400


def test_status_line_shows_progress_and_placeholders() -> None:
    from service.cli.jobs import status_line

    line = status_line(
        {
            "state": "RUNNING",
            "step": 40,
            "samples_per_s": 123.456,
            "loss": 0.123456,
            "world_size": 4,
            "desired_nodes": 2,
            "last_published_step": 30,
            "restarts": 1,
        }
    )
    expected = "RUNNING step 40 123.5 samples/s loss 0.1235 world 4 nodes 2 ckpt 30 restarts 1"
    assert " ".join(line.split()) == expected
    empty = status_line({"state": "PENDING", "desired_nodes": 1})
    assert "step -" in empty and "ckpt -" in empty and "restarts 0" in empty


def test_the_docs_list_every_setting_of_the_service() -> None:
    """The settings table (docs/operations.md) names each ELASTRAIN_* variable Settings reads (a
    new setting that the docs do not mention fails here)."""
    docs = (Path(__file__).resolve().parents[4] / "docs" / "operations.md").read_text(encoding="utf-8")
    table = docs.split("## Settings of the service", 1)[1].split("\n## ", 1)[0]
    missing = [
        f"ELASTRAIN_{name.upper()}"
        for name in Settings.model_fields
        if f"`ELASTRAIN_{name.upper()}`" not in table
    ]
    assert missing == []


@pytest.mark.parametrize(
    ("host", "advertise", "listens", "reached"),
    [
        ("0.0.0.0", "", "http://0.0.0.0:8080 (every IPv4 interface)", "http://127.0.0.1:8080"),
        ("::", "", "http://[::]:8080 (every interface)", "http://127.0.0.1:8080"),
        ("10.1.2.3", "", "http://10.1.2.3:8080", "http://10.1.2.3:8080"),
        (
            "0.0.0.0",
            "https://svc.example:443",
            "http://0.0.0.0:8080 (every IPv4 interface)",
            "https://svc.example:443",
        ),
    ],
)
def test_serve_says_where_it_listens_and_where_workers_reach_it(
    host: str, advertise: str, listens: str, reached: str
) -> None:
    """`serve --host 0.0.0.0` logs where clients can reach it, not http://127.0.0.1:8080."""
    from service.server import serving_line

    line = serving_line(load_settings(host=host, port=8080, advertise_url=advertise))
    assert f"listening on {listens}" in line and f"workers reach it at {reached}" in line


def test_an_s3_location_is_taken_only_with_object_storage(tmp_path: Path) -> None:
    """With the service's object storage (its bucket check left to the integration tests), an
    ``s3://`` directory and resume are kept as locations; without it both are refused naming the
    field and the variables to set."""
    storage = ObjectStorage(env={"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}, check_bucket=False)
    loc = checkpoint_dir("s3://ckpt/runs/a/", root=tmp_path, job_id="j", storage=storage)
    assert loc == S3Location("ckpt", "runs/a")
    assert resume_source("step-00000012", root=tmp_path, job_dir=loc, storage=storage) == (
        "s3://ckpt/runs/a/step-00000012"
    )  # a step of the job's own, under its prefix
    assert (
        resume_source("s3://other/x", root=tmp_path, job_dir=tmp_path / "j", storage=storage)
        == "s3://other/x"
    )
    with pytest.raises(PathError, match=r"checkpoint\.resume.*'\.\.'"):
        resume_source("../x", root=tmp_path, job_dir=loc, storage=storage)
    with pytest.raises(PathError, match=r"checkpoint\.dir.*set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        checkpoint_dir("s3://ckpt/runs/a", root=tmp_path, job_id="j", storage=None)


def test_object_storage_comes_from_the_services_own_environment() -> None:
    environ = {
        "AWS_ENDPOINT_URL": "http://s3:8333",
        "AWS_REGION": "r",
        "PATH": "/bin",
        "AWS_SESSION_TOKEN": "",
    }
    assert ObjectStorage.from_environ(environ) is None  # no access key: not configured
    environ |= {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    storage = ObjectStorage.from_environ(environ)
    assert storage is not None and dict(storage.env) == {
        "AWS_ENDPOINT_URL": "http://s3:8333", "AWS_REGION": "r",
        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
    }  # fmt: skip
    assert launch_storage_env(storage, kubernetes=False) == storage.env
    # on Kubernetes the pods take the credentials from the Secret; only where the store is travels
    assert launch_storage_env(storage, kubernetes=True) == {
        "AWS_ENDPOINT_URL": "http://s3:8333",
        "AWS_REGION": "r",
    }
    assert launch_storage_env(None, kubernetes=False) == {}
