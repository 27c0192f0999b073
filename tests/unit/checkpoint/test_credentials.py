"""Where the store is and who the process is to it, as the AWS SDKs resolve it: a profile's keys,
endpoint and region; web identity (EKS's IAM roles for service accounts) found without asking
STS yet, and asked again before it expires; what the service passes on; a profile that is not
there is one line naming the field (no request is made: no sockets)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from service.jobs.objectstore import ObjectStorage, configured, storage_env
from service.launch.environment import launch_storage_env
from worker.checkpoint.credentials import REASK, CredentialsError, expiry, obtain_fix, pick_region, resolve
from worker.checkpoint.storage import unreachable_fix
from worker.errors import SpecError
from worker.jobspec.location import S3Location

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ROLE_ARN",
            "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")  # fmt: skip


@pytest.fixture
def aws(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No AWS variables of the machine's; empty profile files in ``tmp_path``."""
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    (tmp_path / "config").write_text("")
    (tmp_path / "credentials").write_text("")
    return tmp_path


def test_a_profile_gives_keys_endpoint_and_region(aws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (aws / "config").write_text("[profile team]\nregion = eu-2\nendpoint_url = http://s3.team:8333\n")
    (aws / "credentials").write_text("[team]\naws_access_key_id = k\naws_secret_access_key = s\n")
    monkeypatch.setenv("AWS_PROFILE", "team")
    access = resolve()
    assert (access.endpoint, access.region, access.method) == (
        "http://s3.team:8333",
        "eu-2",
        "shared-credentials-file",
    )
    got = access.credentials()
    assert (got["access_key_id"], got["secret_access_key"], got["expires_at"]) == ("k", "s", None)
    # the environment comes first, as in every AWS SDK
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://other:9000")
    monkeypatch.setenv("AWS_REGION", "r")
    access = resolve()
    assert (access.endpoint, access.region) == ("http://other:9000", "r")


def test_web_identity_is_found_and_asked_again_before_it_expires(
    aws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """STS itself is not asked here (that happens at the first request)."""
    (aws / "token").write_text("a.b.c")
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(aws / "token"))
    monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/ckpt")
    access = resolve()
    assert access.method == "assume-role-with-web-identity" and access.endpoint is None
    assert access.region == "us-east-1"
    assert access.credentials.expires  # obstore asks again after REASK
    now = datetime(2026, 1, 1, tzinfo=UTC)
    assert expiry(True, now) == now + REASK and expiry(False, now) is None


def test_no_credentials_or_a_missing_profile_say_what_to_set(
    aws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        CredentialsError, match=r"no credentials found .* set AWS_ACCESS_KEY_ID .* or AWS_PROFILE"
    ):
        resolve()
    monkeypatch.setenv("AWS_PROFILE", "nosuch")
    with pytest.raises(
        CredentialsError, match=r"\(nosuch\) could not be found .*set AWS_PROFILE to one there"
    ):
        resolve()
    # the service's check at submit: one line naming the field (a 422), before any request
    storage = ObjectStorage(env=storage_env({"AWS_PROFILE": "nosuch"}))
    with pytest.raises(
        SpecError, match=r"^field 'checkpoint\.resume': s3://ckpt/a: .*\(nosuch\) could not be found"
    ):
        storage.check(S3Location("ckpt", "a"), field="checkpoint.resume")


def test_region_and_the_fix_for_a_refusal() -> None:
    assert pick_region({"AWS_REGION": "a"}, "b") == "a"
    assert pick_region({}, "b") == "b" and pick_region({}, None) == "us-east-1"
    loc = S3Location("ckpt", "a")
    assert "set AWS_ACCESS_KEY_ID" in unreachable_fix("AccessDenied", loc, None, "env")
    assert "(found by botocore: shared-credentials-file)" in unreachable_fix(
        "AccessDenied", loc, None, "shared-credentials-file"
    )
    assert "at AWS's default endpoint" in unreachable_fix("NoSuchBucket", loc, None, "env")
    assert "profile's endpoint_url" in unreachable_fix("timed out", loc, "http://s3:1", "env")
    assert "AWS_WEB_IDENTITY_TOKEN_FILE" in obtain_fix("assume-role-with-web-identity")
    assert "role_arn" in obtain_fix("assume-role") and "instance role" in obtain_fix("iam-role")


def test_what_the_service_needs_and_passes_on_for_a_profile_or_web_identity() -> None:
    assert not configured({"AWS_REGION": "r", "AWS_ENDPOINT_URL": "http://s3"})
    assert configured({"AWS_PROFILE": "team"}) and configured({"AWS_CONFIG_FILE": "/etc/aws/config"})
    assert not configured({"AWS_ROLE_ARN": "arn"})
    web = {"AWS_ROLE_ARN": "arn", "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token", "AWS_REGION": "r"}
    assert configured(web)
    storage = ObjectStorage.from_environ({**web, "AWS_PROFILE": "team", "HOME": "/h", "PATH": "/bin"})
    assert storage is not None
    # on one machine the nodes resolve the same credentials from the same files and identity
    assert launch_storage_env(storage, kubernetes=False) == {**web, "AWS_PROFILE": "team"}
    # on Kubernetes a pod has its own identity (its ServiceAccount) or the Secret's keys
    assert launch_storage_env(storage, kubernetes=True) == {"AWS_REGION": "r"}
