"""A checkpoint directory belongs to one job: the marker, the refusal, the
read-only resume from another job's directory, and retention that never deletes there."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.unit.checkpoint.helpers import checkpointer, model_and_optim, save, train
from worker.checkpoint.layout import list_published, read_latest
from worker.checkpoint.offline import reshard
from worker.checkpoint.owner import (
    FORMAT,
    OWNER_FILE,
    DirectoryOwnedError,
    claim,
    job_identity,
    owned_by_other,
    read_owner,
)
from worker.checkpoint.retention import apply_retention
from worker.errors import CheckpointError, SpecError
from worker.jobspec.spec import RetentionSpec


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime: equal snapshots, nothing touched."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
    }


def job_a(tmp_path: Path, steps: int = 2) -> Path:
    """Job "unit" (the helpers' job name) with ``steps`` published steps in ``tmp_path/a``."""
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path / "a")
    for step in range(1, steps + 1):
        train(model, optim, 1)
        save(ck, model, optim, step)
    return tmp_path / "a"


def test_the_first_use_claims_the_directory(tmp_path: Path) -> None:
    a = job_a(tmp_path)
    raw = json.loads((a / OWNER_FILE).read_text())
    assert raw["format"] == FORMAT and raw["job"] == "unit" and raw["claimed_unix"] > 1.6e9
    assert read_owner(a) is not None and read_owner(tmp_path / "nowhere") is None
    before = (a / OWNER_FILE).read_bytes()
    claim(a, "unit")  # the same job again (a restart): the claim stays as it was
    assert (a / OWNER_FILE).read_bytes() == before
    assert not [p for p in a.iterdir() if p.name.startswith(".OWNER")]


def test_another_jobs_directory_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    a = job_a(tmp_path)
    (a / ".staging-00000009-7").mkdir()  # what a new generation of the owner would collect
    before = snapshot(a)
    with pytest.raises(DirectoryOwnedError) as info:
        checkpointer(a, job="other")
    message = str(info.value)
    assert isinstance(info.value, SpecError) and "\n" not in message
    assert "checkpoint.dir" in message and "belongs to job 'unit'" in message
    assert f"checkpoint.resume: {a}" in message
    assert snapshot(a) == before


def test_opened_on_a_thread_another_jobs_directory_is_refused_at_the_first_save(tmp_path: Path) -> None:
    """Peer mode opens a re-formed generation's checkpointer on a thread: the refusal comes at
    the first save (or restore), which writes nothing, and again at the next."""
    a = job_a(tmp_path)
    before = snapshot(a)
    ck = checkpointer(a, job="other", open_on_thread=True)  # no error here: the check runs aside
    model, optim = model_and_optim()
    for step in (3, 4):
        with pytest.raises(DirectoryOwnedError, match="belongs to job 'unit'"):
            save(ck, model, optim, step)
    with pytest.raises(DirectoryOwnedError):
        ck.restore(model=model, optimizer=optim)
    ck.close()
    assert snapshot(a) == before


def test_other_ranks_check_without_writing(tmp_path: Path) -> None:
    a = job_a(tmp_path)
    with pytest.raises(DirectoryOwnedError):
        checkpointer(a, job="other", rank=1, world_size=2)


def test_two_jobs_claiming_at_once_one_wins(tmp_path: Path) -> None:
    target = tmp_path / "shared"
    results: dict[str, str] = {}
    gate = threading.Barrier(8)

    def try_claim(job: str) -> None:
        gate.wait()
        try:
            claim(target, job)
            results[job] = "owner"
        except DirectoryOwnedError:
            results[job] = "refused"

    threads = [threading.Thread(target=try_claim, args=(f"job{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [j for j, r in results.items() if r == "owner"]
    assert len(winners) == 1 and read_owner(target).job == winners[0]  # type: ignore[union-attr]


def test_resume_from_another_jobs_directory_is_read_only(tmp_path: Path) -> None:
    a = job_a(tmp_path, steps=3)
    (a / "step-00000003" / "rank-00000.bin").write_bytes(b"corrupt")  # refused, not set aside
    before = snapshot(a)
    model, optim = model_and_optim(seed=4)
    ck = checkpointer(tmp_path / "b", job="b", resume=str(a / "step-00000002"),
                      retention={"keep_latest": 2})  # fmt: skip
    restored = ck.restore(model=model, optimizer=optim)
    assert restored is not None and restored.step == 2 and restored.path.parent == a
    for step in (3, 4, 5):
        train(model, optim, 1)
        save(ck, model, optim, step)
    assert [s for s, _ in list_published(tmp_path / "b")] == [4, 5] and ck.stats.deleted_total == 1
    assert snapshot(a) == before
    with pytest.raises(CheckpointError, match=r"digest mismatch|bytes on disk"):
        checkpointer(tmp_path / "c", job="c", resume=str(a)).restore(model=model, optimizer=optim)
    assert snapshot(a) == before and read_latest(a) == "step-00000003"


def test_retention_deletes_nothing_another_job_owns(tmp_path: Path) -> None:
    a = job_a(tmp_path, steps=4)
    before = snapshot(a)
    policy = RetentionSpec(keep_latest=2)
    assert apply_retention(a, policy, newest=4, job="other") == []
    assert snapshot(a) == before
    older = [s for s, _ in list_published(a)][:-2]
    assert older and apply_retention(a, policy, newest=4, job="unit") == older


def test_an_unreadable_marker_is_refused_naming_the_file(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / OWNER_FILE).write_text("{not json")
    with pytest.raises(SpecError, match=r"OWNER\.json.*unreadable.*delete the file"):
        claim(a, "unit")
    assert owned_by_other(a, "unit") is not None  # retention deletes nothing on a guess


def test_a_directory_without_a_marker_is_claimed_by_its_first_user(tmp_path: Path) -> None:
    a = job_a(tmp_path)
    (a / OWNER_FILE).unlink()  # written before markers existed
    model, optim = model_and_optim()
    restored = checkpointer(a, job="newer").restore(model=model, optimizer=optim)
    assert restored is not None and read_owner(a).job == "newer"  # type: ignore[union-attr]


def test_reshard_does_not_write_into_an_owned_directory(tmp_path: Path) -> None:
    a = job_a(tmp_path)
    other = job_a(tmp_path / "x")
    with pytest.raises(CheckpointError, match="belongs to job 'unit'"):
        reshard(a, other, world_size=2)
    out = reshard(a, tmp_path / "fresh", world_size=2)
    assert read_owner(out.parent) is None  # the job that uses it claims it


def test_job_identity_is_the_service_job_id_else_the_spec_name() -> None:
    assert job_identity({"ELASTRAIN_JOB_ID": "j-123"}, "train-gpt") == "j-123"
    assert job_identity({}, "train-gpt") == job_identity({"ELASTRAIN_JOB_ID": ""}, "train-gpt") == "train-gpt"
