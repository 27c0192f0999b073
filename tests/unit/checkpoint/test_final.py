"""A run's output: the final step must be published, and a full volume is named as such
(worker.checkpoint.final, pure; and the Checkpointer's view of its final save, real files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.unit.checkpoint.helpers import checkpointer, model_and_optim, save, train
from worker import failpoints
from worker.checkpoint.final import no_space, unpublished_final


@pytest.fixture(autouse=True)
def _no_failpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.reset_hits()


@pytest.mark.parametrize(
    ("reason", "full"),
    [
        ("rank 1 failed to stage step 20: OSError: [Errno 28] No space left on device", True),
        ("publishing failed: [Errno 28] No space left on device", True),
        ("OSError: [Errno 122] Disk quota exceeded: '/ck/.staging-00000020-1/rank-00001.bin'", True),
        ("rank 0 failed to stage step 20: OSError: [Errno 5] Input/output error", False),
        ("timed out waiting for 1 of 2 reports", False),
    ],
)
def test_no_space_reads_the_reason_a_rank_reported(reason: str, full: bool) -> None:
    assert no_space(reason) is full


def test_a_published_final_step_is_kept() -> None:
    assert unpublished_final(final_step=30, newest_published=30, reason=None, job_dir="/ck") is None


def test_an_unpublished_final_step_names_the_error_the_directory_and_the_kept_step() -> None:
    line = unpublished_final(
        final_step=15000, newest_published=2000, reason="[Errno 28] No space left on device",
        job_dir="/vol/ck",
    )  # fmt: skip
    assert line is not None and "\n" not in line
    assert "final checkpoint (step 15000) could not be published in /vol/ck" in line
    assert "No space left on device" in line
    assert "newest published checkpoint is step 2000 (13000 steps are not saved)" in line


def test_nothing_published_says_so() -> None:
    line = unpublished_final(final_step=20, newest_published=None, reason=None, job_dir="/ck")
    assert line is not None and "no checkpoint of this run is published in /ck" in line
    assert "its save did not complete" in line


def test_the_checkpointer_knows_its_final_save_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path, on_event=lambda name, fields: events.append((name, fields)))
    save(ck, model, optim, 1)
    monkeypatch.setenv(failpoints.ENV, "during_shard_write=enospc")
    train(model, optim, 1)
    save(ck, model, optim, 2)
    ck.close()
    aborted = [f for name, f in events if name == "checkpoint_aborted"]
    assert aborted and aborted[0]["step"] == 2 and aborted[0]["no_space"]
    assert aborted[0]["path"] == str(tmp_path) and "No space left on device" in aborted[0]["reason"]
    assert ck.stats.no_space_aborts_total == 1
    line = ck.final_problem(2)
    assert line is not None and "step 2" in line and str(tmp_path) in line
    assert "newest published checkpoint is step 1" in line and "No space left on device" in line
    assert ck.final_problem(1) is None, "a step this checkpointer did not save last is not its final one"


def test_a_final_save_that_published_is_no_problem(tmp_path: Path) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path, async_save=True)
    save(ck, model, optim, 1)
    ck.close()
    assert ck.final_problem(1) is None and ck.stats.no_space_aborts_total == 0


def test_a_final_save_in_the_generation_before_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peer mode: the final window asked for a join, so the final save ran in the old
    generation's checkpointer, which the new one closes (``after``); its outcome is the run's."""
    model, optim = model_and_optim()
    old = checkpointer(tmp_path, async_save=True)
    save(old, model, optim, 1)
    old.close()  # step 1 published
    monkeypatch.setenv(failpoints.ENV, "async_before_write=enospc")
    train(model, optim, 1)
    save(old, model, optim, 2)
    new = checkpointer(tmp_path, generation=1, after=old, open_on_thread=True)
    new.close()
    line = new.final_problem(2)
    assert line is not None and "step 2" in line and "newest published checkpoint is step 1" in line
