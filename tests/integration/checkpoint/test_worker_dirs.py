"""The real worker (``python -m worker``, one process) and what it finds in a checkpoint
directory: a bomb manifest is skipped like a corrupt shard (issue 13 item 2)."""

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
