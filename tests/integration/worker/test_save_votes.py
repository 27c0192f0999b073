"""A time-based checkpoint interval reads each rank's own clock; the ranks agree on every save
through the step's one all-reduce (the vote travels with the non-finite flag), so no rank waits in
a save the others skipped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.launch import run_worker, write_spec

pytestmark = pytest.mark.integration


def test_ranks_agree_on_saves_their_clocks_decide(tmp_path: Path) -> None:
    spec = {
        "name": "clock-saves",
        "model": {"name": "mlp", "kwargs": {"hidden": 16}},
        "data": {"name": "synthetic", "samples": 4096},
        "micro_batch_size": 8,
        "grad_accum_steps": 2,
        "max_steps": 120,
        "log_every_steps": 20,
        "checkpoint": {
            "dir": str(tmp_path / "ck"),
            "interval_seconds": 0.05,
            "retention": {"keep_latest": 2},
        },
    }
    run = run_worker(write_spec(tmp_path, spec), nproc=2, timeout=240)
    assert run.code == 0, run.stderr[-3000:]
    published = [e["step"] for e in run.all("checkpoint_published")]
    assert len(published) >= 3 and published[-1] == 120, published
    assert not [e for e in run.events if "abort" in e["event"]]
    assert run.last("finished")["step"] == 120
