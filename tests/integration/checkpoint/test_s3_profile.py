"""Object storage configured by an AWS profile only, against a real S3-compatible server
(SeaweedFS): the keys, the endpoint and the region come from profile files named by
``AWS_PROFILE``, ``AWS_CONFIG_FILE`` and ``AWS_SHARED_CREDENTIALS_FILE`` (no ``AWS_ACCESS_KEY_ID``
or ``AWS_ENDPOINT_URL`` anywhere); a job trains, publishes and resumes in the bucket, the offline
commands read it, ``elastrain report s3://...`` reads the run's events and checkpoints from the
bucket (without torch), and a profile that is not there is one line naming checkpoint.dir,
exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.checkpoint.harness import REPO, cli
from tests.integration.launch import run_worker, worker_env, write_spec
from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, SeaweedServer
from tests.specs import raw_spec

pytestmark = pytest.mark.integration

AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
            "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP", "AWS_PROFILE")  # fmt: skip
KILL_AT_STEP_3 = "after_grad_sync=kill@0#3^0"  # rank 0, after step 2 was published, first attempt


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


def report(*args: str) -> subprocess.CompletedProcess[str]:
    """``elastrain report`` in a fresh interpreter; stderr ends with the modules it imported."""
    code = (
        "import sys; from service.cli import main; code = main(sys.argv[1:]); "
        "sys.stderr.write(' '.join(sys.modules)); sys.exit(code)"
    )
    cmd = [sys.executable, "-c", code, "report", *args]
    return subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, cwd=REPO, timeout=120)


def test_a_job_on_s3_configured_by_a_profile_only_and_its_report(profile_env: None, tmp_path: Path) -> None:
    """The worker under torchrun, rank 0 killed in step 3 (step 2 published); one restart."""
    loc = f"s3://ckpt/profiles/{uuid.uuid4().hex[:12]}"
    raw = raw_spec("s3-profile", max_steps=4, log_every_steps=1, checkpoint={"dir": loc, "interval_steps": 2})
    env = {"PYTHONPATH": str(REPO), "ELASTRAIN_FAILPOINTS": KILL_AT_STEP_3}
    run = run_worker(write_spec(tmp_path, raw), nproc=1, max_restarts=1, env=env, timeout=300)
    assert run.code == 0, run.stderr[-3000:]
    assert "elastrain failpoint after_grad_sync: kill" in run.stderr
    resumed = run.all("resumed")
    assert resumed and resumed[0]["step"] == 2 and str(resumed[0]["checkpoint"]).startswith(loc)
    verify = cli("verify", loc)
    assert verify.returncode == 0 and "every block verified" in verify.stdout, verify.stderr
    assert f"{loc}/step-00000004" in cli("inspect", loc).stdout
    # the report of the run, from the bucket: both attempts' events and the stored checkpoints
    text = report(loc)
    assert text.returncode == 0, text.stderr[-3000:]
    assert "finished at step 4" in text.stdout and "restarts       1\n    #1 failure at" in text.stdout, (
        text.stdout
    )
    assert f"stored         2 in {loc}: step 2 (W=1" in text.stdout, text.stdout
    assert " torch " not in text.stderr  # the report needs no torch
    data = json.loads(report(loc, "--json").stdout)
    assert data["checkpoints"]["published"] == 2 and len(data["restarts"]) == 1


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
