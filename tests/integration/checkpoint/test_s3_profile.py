"""Object storage configured by an AWS profile only, against a real S3-compatible server
(SeaweedFS): the keys, the endpoint and the region come from profile files named by
``AWS_PROFILE``, ``AWS_CONFIG_FILE`` and ``AWS_SHARED_CREDENTIALS_FILE`` (no ``AWS_ACCESS_KEY_ID``
or ``AWS_ENDPOINT_URL`` anywhere); a job trains, publishes and resumes in the bucket, the offline
commands read it, and a profile that is not there is one line naming checkpoint.dir, exit 2."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.integration.checkpoint.harness import REPO, cli, torchrun
from tests.integration.launch import run_worker, write_spec
from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, SeaweedServer
from tests.specs import raw_spec

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
            "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP", "AWS_PROFILE")  # fmt: skip
KILL_AFTER_FIRST = "after_latest_update=kill@0^0"


@pytest.fixture
def profile_env(s3server: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process and its children see the store through profile ``store`` only."""
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    config, credentials = tmp_path / "aws-config", tmp_path / "aws-credentials"
    config.write_text(f"[profile store]\nregion = {REGION}\nendpoint_url = {s3server.endpoint}\n")
    credentials.write_text(
        f"[store]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    monkeypatch.setenv("AWS_PROFILE", "store")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata to ask here


def test_a_job_on_s3_configured_by_a_profile_only(profile_env: None) -> None:
    loc = f"s3://ckpt/profiles/{uuid.uuid4().hex[:12]}"
    run = torchrun(
        1, "--dir", loc, "--steps", "4", "--every", "2", "--seed", "1",
        max_restarts=1, extra_env={"PYTHONPATH": str(REPO), "ELASTRAIN_FAILPOINTS": KILL_AFTER_FIRST},
    ).check()  # fmt: skip
    resumed = run.all("resumed")
    assert resumed and resumed[0]["step"] == 2 and str(resumed[0]["path"]).startswith(loc)
    verify = cli("verify", loc)
    assert verify.returncode == 0 and "every block verified" in verify.stdout, verify.stderr
    assert f"{loc}/step-00000004" in cli("inspect", loc).stdout


def test_a_profile_that_is_not_there_is_one_line_naming_the_field(
    profile_env: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_PROFILE", "nosuch")
    raw = raw_spec("s3-profile", checkpoint={"dir": "s3://ckpt/profiles/x"})
    run = run_worker(write_spec(tmp_path, raw), env={"PYTHONPATH": str(REPO)}, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.code == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert lines[0].startswith("elastrain worker: error: field 'checkpoint.dir': s3://ckpt/profiles/x: ")
    assert "(nosuch) could not be found" in lines[0] and "set AWS_PROFILE to one there" in lines[0]
