"""A full checkpoint volume: the run's final checkpoint cannot be published, so the run fails
(under bare torchrun: a non-zero exit and one line; under the service: FAILED) with a reason
that names the error, the directory and the newest published step; the earlier save that hit
the full volume is an event with the same facts, and a metric.

The volume is a real 128 KiB tmpfs (one 80 KiB checkpoint of one rank fits, a second does not) where this
machine may mount one (root or CAP_SYS_ADMIN); elsewhere every save after the first fails by
the ENOSPC failpoint in the shard write, the same error the kernel gives.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.launch import run_worker, write_spec
from tests.integration.worker.test_resume import spec
from tests.integration.worker.test_service_e2e import Service, job_spec

pytestmark = pytest.mark.integration
AFTER_THE_FIRST_SAVE = "during_shard_write=enospc#2"  # a run of two saves: its second fails


def small_volume(mount: Path) -> dict[str, str]:
    """Make ``mount`` a 128 KiB tmpfs; returns the environment the run needs: none, or (where
    mounting is refused) the failpoint that fails the second save with ENOSPC."""
    mount.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    return {} if done.returncode == 0 else {"ELASTRAIN_FAILPOINTS": AFTER_THE_FIRST_SAVE}


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str]]]:
    mount = tmp_path / "svc" / "checkpoints" / "vol"  # inside the service's storage root
    env = small_volume(mount)
    yield mount, env
    if not env:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def says_what_is_kept(reason: str, where: Path) -> None:
    assert "final checkpoint (step 20) could not be published" in reason, reason
    assert "No space left on device" in reason and str(where) in reason, reason
    assert "newest published checkpoint is step 10" in reason, reason


def test_bare_torchrun_exits_non_zero_naming_the_error_the_path_and_the_kept_step(
    tmp_path: Path, volume: tuple[Path, dict[str, str]]
) -> None:
    mount, env = volume
    ck = mount / "ck"
    run = run_worker(write_spec(tmp_path, spec(ck, max_steps=20)), nproc=1, env=env)
    assert run.code != 0, run.stderr[-3000:]
    lines = [ln for ln in run.stderr.splitlines() if "could not be published" in ln]
    assert len(lines) == 1, run.stderr[-3000:]  # one line, from the one rank
    says_what_is_kept(lines[0], ck)
    assert not run.all("finished"), "a run without its output reported finished"
    aborted = run.last("checkpoint_aborted")
    assert aborted["step"] == 20 and aborted["no_space"] and aborted["path"] == str(ck), aborted
    assert [e["step"] for e in run.all("checkpoint_published")] == [10]
    assert (ck / "latest").read_text().strip().endswith("00000010")
    assert not list(ck.glob(".staging-*")), "the aborted save's staging is left behind"


def test_service_fails_the_job_with_the_reason(tmp_path: Path, volume: tuple[Path, dict[str, str]]) -> None:
    mount, env = volume
    service = Service(tmp_path / "svc", env)  # its storage root holds the volume
    over: dict[str, Any] = {"max_steps": 20, "nproc_per_node": 1, "max_restarts": 2}
    try:
        service.start()
        job_id = service.submit(job_spec(**over) | {"checkpoint": {"dir": "vol/ck", "interval_steps": 10}})
        final = service.finished(job_id, timeout=240)
        page = service.http.get("/metrics").text
        listed = service.http.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]
    finally:
        service.stop()
    assert final["state"] == "FAILED", final
    ck = Path(final["checkpoint_dir"])
    assert ck == (mount / "ck").resolve(), ck
    says_what_is_kept(final["reason"], ck)
    assert final["restarts"] == 0, "a restart cannot make the volume larger"
    assert [c["step"] for c in listed] == [10], listed
    aborts = [e["message"] for e in final["events"] if e["kind"] == "checkpoint_aborted"]
    assert aborts and "step 20" in aborts[0] and "No space left on device" in aborts[0], final["events"]
    full = [
        s.value
        for f in text_string_to_metric_families(page)
        for s in f.samples
        if s.name == "elastrain_checkpoints_no_space_aborts_total" and s.labels.get("job_id") == job_id
    ]
    assert full and full[0] >= 1, "the full volume is not counted"
