"""The real worker (``python -m worker``, one process) and what it finds in a checkpoint
directory: a bomb manifest is skipped like a corrupt shard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.launch import Run, run_worker, write_spec

pytestmark = pytest.mark.integration


def spec(ck: Path, *, name: str = "dirs", **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": name,
        "model": {"name": "mlp", "kwargs": {"hidden": 16}},
        "data": {"name": "synthetic", "samples": 256},
        "micro_batch_size": 8,
        "max_steps": 20,
        "seed": 5,
        "log_every_steps": 10,
        "checkpoint": {"dir": str(ck), "interval_steps": 10},
    }
    return base | over


def work(tmp: Path, tag: str, body: dict[str, Any]) -> Run:
    return run_worker(write_spec(tmp, body, f"{tag}.json"), timeout=240)


def test_a_bomb_manifest_is_skipped_and_the_previous_step_used(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    first = work(tmp_path, "first", spec(ck))
    assert first.code == 0, first.stderr[-3000:]
    (ck / "step-00000020" / "manifest.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    again = work(tmp_path, "again", spec(ck, max_steps=30))
    assert again.code == 0, again.stderr[-3000:]
    (refused,) = again.all("checkpoint_refused")
    assert "manifest.json" in refused["reason"] and "nested 200000 levels deep" in refused["reason"]
    assert again.last("resumed")["step"] == 10
    assert again.last("finished")["step"] == 30


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
    }


def test_another_jobs_directory_is_refused_and_read_only_resume_leaves_it_alone(tmp_path: Path) -> None:
    """A spec whose checkpoint.dir names job a's directory is refused with a
    line naming the field and the fix, and nothing in it changes; ``checkpoint.resume: <dir>``
    starts from job a's checkpoint and writes only into the job's own directory."""
    owned = tmp_path / "a"
    first = work(tmp_path, "a", spec(owned, name="a"))
    assert first.code == 0, first.stderr[-3000:]
    before = _tree(owned)
    taken = work(tmp_path, "b", spec(owned, name="b", seed=9))
    # Exit 1 today; 2 once worker/main.py claims the directory before the group starts.
    assert taken.code == 2 and "Traceback" not in taken.stderr
    assert "field 'checkpoint.dir'" in taken.stderr and "belongs to job 'a'" in taken.stderr
    assert f"checkpoint.resume: {owned}" in taken.stderr
    assert _tree(owned) == before and taken.all("resumed") == []
    ck = {"dir": str(tmp_path / "c"), "interval_steps": 10, "resume": str(owned)}
    started = work(tmp_path, "c", spec(tmp_path / "c", name="c", max_steps=30, checkpoint=ck))
    assert started.code == 0, started.stderr[-3000:]
    assert started.last("resumed")["step"] == 20 and started.last("finished")["step"] == 30
    assert _tree(owned) == before
