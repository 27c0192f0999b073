from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.unit.checkpoint.synth import TENSORS, synth, write_published
from worker.checkpoint.layout import (
    collect_orphans,
    list_published,
    parse_staging_dir,
    parse_step_dir,
    read_latest,
    resolve_checkpoint,
    staging_dir_name,
    step_dir_name,
)
from worker.checkpoint.publish import publish_staged
from worker.errors import CheckpointError


def test_names() -> None:
    assert step_dir_name(12) == "step-00000012" and parse_step_dir("step-00000012") == 12
    assert staging_dir_name(12, 3) == ".staging-00000012-3" and parse_staging_dir(".staging-00000012-3") == (
        12,
        3,
    )
    assert parse_step_dir("step-12") is None and parse_step_dir(".staging-00000012-3") is None


def test_publish_is_idempotent_and_latest_only_moves_forward(tmp_path: Path) -> None:
    s10, s20 = synth(TENSORS, 2, step=10), synth(TENSORS, 2, step=20)
    write_published(tmp_path, s20)
    assert read_latest(tmp_path) == "step-00000020"
    write_published(tmp_path, s10)
    assert read_latest(tmp_path) == "step-00000020"
    assert [s for s, _ in list_published(tmp_path)] == [10, 20]
    # the same step again: the published one is kept, the new staging discarded
    staging = tmp_path / staging_dir_name(20, 1)
    staging.mkdir()
    (staging / "junk").write_bytes(b"x")
    m = dataclasses.replace(s20.manifest, generation=1)
    assert publish_staged(tmp_path, staging, m) == tmp_path / "step-00000020"
    assert not staging.exists()
    assert publish_staged(tmp_path, staging, m) == tmp_path / "step-00000020"  # a retry, staging gone


def test_resolve(tmp_path: Path) -> None:
    write_published(tmp_path, synth(TENSORS, 2, step=10))
    assert resolve_checkpoint(tmp_path) == tmp_path / "step-00000010"
    assert resolve_checkpoint(tmp_path / "step-00000010") == tmp_path / "step-00000010"
    (tmp_path / "latest").unlink()
    assert resolve_checkpoint(tmp_path) == tmp_path / "step-00000010"
    staging = tmp_path / staging_dir_name(11, 0)
    staging.mkdir()
    with pytest.raises(CheckpointError, match="never read"):
        resolve_checkpoint(staging)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no published"):
        resolve_checkpoint(tmp_path / "empty")


def test_staging_dirs_are_never_listed(tmp_path: Path) -> None:
    write_published(tmp_path, synth(TENSORS, 2, step=10))
    (tmp_path / staging_dir_name(12, 0)).mkdir()
    (tmp_path / "step-00000013").mkdir()  # no manifest: not published
    assert [s for s, _ in list_published(tmp_path)] == [10]


def test_collect_orphans_keeps_current_generation(tmp_path: Path) -> None:
    for name in (staging_dir_name(5, 0), staging_dir_name(6, 1), staging_dir_name(7, 2), ".trash-step-1-4"):
        (tmp_path / name).mkdir()
    (tmp_path / ".latest.tmp-123").write_text("x")
    (tmp_path / "run-record.json").write_text("{}")
    removed = collect_orphans(tmp_path, current_generation=2)
    assert sorted(removed) == sorted(
        [staging_dir_name(5, 0), staging_dir_name(6, 1), ".trash-step-1-4", ".latest.tmp-123"]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == [staging_dir_name(7, 2), "run-record.json"]
