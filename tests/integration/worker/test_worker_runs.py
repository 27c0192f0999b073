"""The worker as a user runs it: torchrun on CPU/gloo or one plain process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launch import REPO, run_worker, worker_env, write_spec
from worker.jobspec.spec import LRScheduleSpec
from worker.train.schedule import lr_at

pytestmark = pytest.mark.integration


def mlp_spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "t",
        "model": {"name": "mlp", "kwargs": {"hidden": 32}},
        "data": {"name": "synthetic", "samples": 512},
        "micro_batch_size": 8,
        "grad_accum_steps": 2,
        "max_steps": 12,
        "seed": 3,
        "deterministic": True,
        "log_every_steps": 4,
    }
    return base | over


def test_fp16_non_finite_on_one_rank_skips_the_step_on_all_ranks(tmp_path: Path) -> None:
    warmup = {"warmup_samples": 12 * 32}  # the LR rises at every step: a schedule that moved on a skip shows
    spec = write_spec(
        tmp_path,
        mlp_spec(precision="fp16", loss_scale={"init_scale": 1024.0}, lr_schedule=warmup, log_every_steps=1),
    )
    # The gradient is poisoned on rank 1 only, after DDP's all-reduce: only the MAX-reduced flag
    # can make rank 0 skip too.
    run = run_worker(spec, nproc=2, env={"ELASTRAIN_FAILPOINTS": "after_grad_sync=nonfinite@1#5"})
    assert run.code == 0, run.stderr[-3000:]
    skipped = run.all("skipped_step")
    assert [e["step"] for e in skipped] == [4]  # the 5th window; 4 steps had succeeded
    assert skipped[0]["loss_scale"] == 512.0
    done = run.last("finished")
    assert done["step"] == 12 and done["skipped_steps"] == 1
    assert done["samples_seen"] == 12 * 32 and done["samples_skipped"] == 32
    assert done["rank_params_digests"][0] == done["rank_params_digests"][1]
    # The LR of the k-th successful step is the schedule's at (k - 1) x 32 samples: the skipped
    # window did not advance it (the step after the skip uses the skipped window's LR again).
    lrs = [(e["step"], e["lr"]) for e in run.all("progress")]
    schedule = LRScheduleSpec(**warmup)
    assert lrs == [
        (k, lr_at((k - 1) * 32, base_lr=1e-3, factor=1.0, schedule=schedule, total=12 * 32))
        for k in range(1, 13)
    ]


def test_same_seed_same_digest(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, mlp_spec())
    first, second = run_worker(spec, nproc=2), run_worker(spec, nproc=2)
    assert first.code == 0 and second.code == 0, first.stderr[-2000:] + second.stderr[-2000:]
    assert first.last("finished")["params_digest"] == second.last("finished")["params_digest"]
    other = run_worker(write_spec(tmp_path, mlp_spec(seed=4), "other.json"), nproc=2)
    assert other.last("finished")["params_digest"] != first.last("finished")["params_digest"]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiny_gpt_learns_in_low_precision_on_fp32_master_state(tmp_path: Path, precision: str) -> None:
    spec = {
        "name": "gpt",
        "model": {"name": "tiny-gpt", "kwargs": {"d_model": 16, "n_layers": 1, "n_heads": 2}},
        "data": {"name": "tokens", "samples": 1600, "kwargs": {"vocab_size": 16, "seq_len": 8}},
        "precision": precision,
        "micro_batch_size": 16,
        "max_steps": 100,
        "optimizer": {"lr": 0.01},
        "log_every_steps": 10,
        "checkpoint": {"dir": str(tmp_path / "ck")},
    }
    run = run_worker(write_spec(tmp_path, spec))
    assert run.code == 0, run.stderr[-3000:]
    losses = [e["loss"] for e in run.all("progress")]
    assert losses[-1] < 0.8 * losses[0], losses
    table = run.last("run_record")["precision_table"]
    assert table["matmul/linear"]["output"] == precision
    # What is really there: the state the final checkpoint holds (copied from the live tensors),
    # and the dtypes the worker observed once the optimizer had created its moments.
    manifest = json.loads((tmp_path / "ck" / "step-00000100" / "manifest.json").read_text())
    params = {n: t["dtype"] for n, t in manifest["tensors"].items() if n.startswith("model.")}
    moments = {
        n: t["dtype"]
        for n, t in manifest["tensors"].items()
        if n.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq")
    }
    assert len(moments) == 2 * len(params) > 0
    assert set(params.values()) == set(moments.values()) == {"float32"}
    assert run.last("first_step")["state_dtypes"] == {"params": ["fp32"], "optimizer_state": ["fp32"]}
    record = json.loads((tmp_path / "ck" / "run-record.json").read_text())
    row = record["precision_table"]["optimizer (master params, moments)"]
    assert row == {"input": "fp32", "accumulate": "fp32", "output": "fp32"}


def test_run_record_says_how_it_computed(tmp_path: Path) -> None:
    """Also: the spec asks for peer recovery, which a bare torchrun cannot give; the run says so
    (stderr, once, and the record's notes) instead of silently recovering by restart."""
    body = mlp_spec(max_steps=2, checkpoint={"dir": str(tmp_path / "ck")}, recovery={"mode": "peer"})
    run = run_worker(write_spec(tmp_path, body))
    assert run.code == 0, run.stderr[-2000:]
    record = json.loads((tmp_path / "ck" / "run-record.json").read_text())
    assert record["world_size"] == 1 and record["backend"] == "gloo"
    assert record["determinism"]["use_deterministic_algorithms"] is True
    assert record["batch"]["accum_steps"] == 2 and record["spec"]["seed"] == 3
    assert {"python", "torch", "numpy"} <= record["versions"].keys()
    # The collector, off while the process started (worker/start/startgc.py), runs again in training,
    # and what start-up left alive (torch's modules and the like) was frozen out of its passes.
    assert record["gc"]["enabled"] is True and record["gc"]["frozen_at_start"] > 100_000, record["gc"]
    (note,) = [n for n in record["notes"] if n.startswith("recovery.mode is 'peer'")]
    assert run.stderr.count(f"elastrain worker: note: {note}") == 1


@pytest.mark.parametrize(
    ("change", "env", "field"),
    [
        ({"micro_batch_size": "8"}, {}, "micro_batch_size"),
        ({"unknown": 1}, {}, "unknown"),
        ({"model": {"name": "resnet"}}, {}, "model.name"),
        ({"max_steps": 0}, {}, "max_steps"),
        ({"model": {"name": "mlp", "kwargs": {"width": 3}}}, {}, "model.kwargs.width"),
        ({"model": {"factory": "nosuchmod:build"}}, {}, "model.factory"),
        ({"model": {"name": "mlp", "kwargs": {"config": {"hidden": 3}}}}, {}, "model.kwargs.config"),
        (
            {"grad_accum_steps": None, "global_batch_size": 24},
            {"RANK": "0", "WORLD_SIZE": "2"},
            "global_batch_size",
        ),
        ({"checkpoint": {"dir": "s3://ckpt/runs/a"}}, {}, "checkpoint.dir"),
        ({"checkpoint": {"resume": "latest"}}, {}, "checkpoint.resume"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, change: dict[str, Any], env: dict[str, str], field: str
) -> None:
    spec = write_spec(tmp_path, mlp_spec(**change))
    run = run_worker(spec, env=env)
    assert run.code == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert f"'{field}" in lines[0]
    assert not (REPO / "s3:").exists()  # a URL is never taken for a local directory


def test_a_spec_that_cannot_run_is_refused_before_torch_is_imported(tmp_path: Path) -> None:
    """A typo is answered at once (~0.6 s here), not after torch's ~4 s of imports on every rank."""
    spec = write_spec(tmp_path, mlp_spec(max_stepz=3))
    probe = "import sys; from worker.main import main; print(main(sys.argv[1:]), 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe, "--config", str(spec)],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=worker_env(None),
    )  # fmt: skip
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("elastrain worker: error: field 'max_stepz'"), line
