"""Jobs on ``s3://`` under the service, against a real S3-compatible server (SeaweedFS): the
`elastrain serve` console script with object storage credentials in its environment, real
torchrun workers. A worker SIGKILLed mid-run resumes from the bucket and the job ends on the
same state as the same job on a local directory under bare torchrun; the service publishes each
step in the bucket and applies retention there; `elastrain report JOB_ID` reads the run's events
from the bucket; a missing bucket and refused credentials are a
422 naming ``checkpoint.dir`` at submit, before anything is stored."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.launch import REPO, worker_env
from tests.integration.worker.test_service_e2e import Service, bare_run_digest, job_spec, until
from tests.s3server import SECRET_KEY, SeaweedServer
from tests.shared_runs import once
from worker.checkpoint import storage
from worker.checkpoint.remote import list_published, read_latest
from worker.checkpoint.storage import storage_for
from worker.jobspec.location import S3Location

pytestmark = pytest.mark.integration

STEPS = 30
KILL_RANK_1 = "after_grad_sync=kill@1#15^0"  # rank 1, at step 15, in the first attempt only
CRASH_IN_PUBLISH = "after_publish_rename=kill#1"  # the service, once step 10's manifest is created


@pytest.fixture(scope="module")
def s3server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    with SeaweedServer(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture(scope="module")
def s3_env(s3server: SeaweedServer) -> Iterator[None]:
    """This process reads the bucket too, with the variables the service has."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3server.env().items():
            mp.setenv(k, v)
        mp.setattr(storage, "_stores", {})  # this process's clients: made anew for this server
        yield


@pytest.fixture(scope="module")
def s3_service(
    s3server: SeaweedServer, s3_env: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """The service with the store's credentials in its environment; it dies inside its first
    publish, and its jobs' rank 1 is killed once at step 15."""
    env = _env(s3server) | {"ELASTRAIN_FAILPOINTS": f"{KILL_RANK_1},{CRASH_IN_PUBLISH}"}
    svc = Service(tmp_path_factory.mktemp("svc"), env)
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def _env(server: SeaweedServer, *, secret: str = SECRET_KEY) -> dict[str, str]:
    """The store's standard variables; this tree's modules on the path (whichever install)."""
    return server.env(secret=secret) | {"PYTHONPATH": str(REPO)}


def _digest(location: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "service", "checkpoint", "digest", location],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    return out.stdout.split()[0]


def _prefix() -> S3Location:
    return S3Location("ckpt", f"svc/{uuid.uuid4().hex[:12]}")


def bare30_digest(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The 30-step job on a local directory under bare torchrun: its final digest (trained once
    a session, shared with the fault rows)."""
    return str(once(tmp_path_factory, "faults-bare30", lambda tmp: bare_run_digest(tmp, max_steps=30)))


def test_a_job_on_s3_survives_a_service_crash_and_a_worker_sigkill(
    s3server: SeaweedServer, s3_service: Service, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The service is SIGKILLed right after it created step 10's manifest in the bucket (before
    it recorded the step), and started again: it adopts the step from the bucket. Rank 1 is then
    killed at step 15 and the group resumes from the bucket. Retention keeps the newest two."""
    svc, loc = s3_service, _prefix()
    retention = {"keep_latest": 2}
    spec = job_spec(max_steps=STEPS) | {
        "checkpoint": {"dir": str(loc), "interval_steps": 10, "retention": retention}
    }
    job_id = svc.submit(spec)
    assert svc.proc is not None
    code = svc.proc.wait(timeout=300)  # the publish failpoint kills it; nothing else stops it
    assert code == -signal.SIGKILL, f"the service exited with {code}:\n{svc.log()[-3000:]}"
    assert "elastrain failpoint after_publish_rename: kill" in svc.log()
    assert [s for s, _ in list_published(loc)] == [10]  # committed in the bucket, not recorded
    svc.env = _env(s3server) | {"ELASTRAIN_FAILPOINTS": KILL_RANK_1}  # as an operator would
    svc.start()
    until(lambda: 10 in _steps(svc, job_id), "step 10 adopted from the bucket", 120)
    final = svc.finished(job_id)
    assert final["state"] == "SUCCEEDED", (final, svc.node_logs(job_id)[-3000:])
    assert final["checkpoint_dir"] == str(loc)
    assert "elastrain failpoint after_grad_sync: kill" in svc.node_logs(job_id), "the kill never happened"
    assert final["restarts"] >= 1, final
    # the service published every step in the bucket and retention kept the newest two
    assert [s for s, _ in list_published(loc)] == [20, 30]
    assert storage_for(loc).listing(loc.key("step-00000010"))[1] == []  # its shards are gone too
    assert read_latest(loc)[0] == "step-00000030"
    listed = svc.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]
    assert [c["step"] for c in listed] == [20, 30] and all(c["dir"].startswith(str(loc)) for c in listed)
    resume = svc.http.get(f"/v1/jobs/{job_id}/resume", params={"world_size": 3}).json()
    assert resume["checkpoint"]["dir"] == f"{loc}/step-00000030" and resume["checkpoint"]["reshard"]
    assert not (svc.data_dir / "checkpoints" / job_id).exists()  # nothing went to the storage root
    assert not (REPO / "s3:").exists()  # nor to a local directory named like the URL
    # the same job on a local directory under bare torchrun ends on the same state
    assert _digest(str(loc)) == bare30_digest(tmp_path_factory)
    # `elastrain report JOB_ID`: the service's record, and the run's events from the bucket
    report = subprocess.run(
        [sys.executable, "-m", "service", "report", job_id, "--url", svc.url],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env=worker_env({"ELASTRAIN_API_TOKEN": svc.token}),
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    assert f"({loc})" in report.stdout and "finished at step 30" in report.stdout, report.stdout
    assert f"stored         2 in {loc}: step 20 (W=2" in report.stdout, report.stdout
    assert "incidents      " in report.stdout, report.stdout  # the service's view of the worker loss


def _steps(svc: Service, job_id: str) -> list[int]:
    return [c["step"] for c in svc.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]]


def test_a_missing_bucket_is_422_at_submit(s3_service: Service) -> None:
    spec = job_spec() | {"checkpoint": {"dir": "s3://no-such-bucket/x"}}
    answer = s3_service.http.post("/v1/jobs", json=spec)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["field"] == "checkpoint.dir", error
    assert "bucket 'no-such-bucket' does not exist" in error["message"], error
    resume = job_spec() | {"checkpoint": {"resume": "s3://no-such-bucket/x/step-00000010"}}
    answer = s3_service.http.post("/v1/jobs", json=resume)
    assert answer.status_code == 422 and answer.json()["error"]["field"] == "checkpoint.resume", answer.text


def test_refused_credentials_are_422_at_submit(s3server: SeaweedServer, tmp_path: Path) -> None:
    wrong = Service(tmp_path, _env(s3server, secret="not-the-secret"))
    wrong.start()
    try:
        spec = job_spec() | {"checkpoint": {"dir": "s3://ckpt/svc/refused"}}
        answer = wrong.http.post("/v1/jobs", json=spec)
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["field"] == "checkpoint.dir", error
        assert "refused the credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in error["message"]
        assert wrong.http.get("/v1/jobs").json()["jobs"] == []  # nothing was stored
    finally:
        wrong.stop()


def test_a_profile_that_is_not_there_is_422_at_submit(s3server: SeaweedServer, tmp_path: Path) -> None:
    """A service configured by a profile (AWS_PROFILE and the files it names) whose profile is
    not in them: a submit on s3:// is a 422 naming the field and the fix."""
    (tmp_path / "aws-config").write_text(f"[profile store]\nendpoint_url = {s3server.endpoint}\n")
    env = {"AWS_PROFILE": "nosuch", "AWS_CONFIG_FILE": str(tmp_path / "aws-config"), "PYTHONPATH": str(REPO)}
    svc = Service(tmp_path, env)
    svc.start()
    try:
        answer = svc.http.post("/v1/jobs", json=job_spec() | {"checkpoint": {"dir": "s3://ckpt/svc/profile"}})
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["field"] == "checkpoint.dir", error
        assert "(nosuch) could not be found" in error["message"], error
        assert "set AWS_PROFILE to one there" in error["message"], error
    finally:
        svc.stop()
