"""Data on disk, loaded ahead of the step, with the real worker under torchrun.

A token file (nanoGPT's format) trains the same bits whether batches are loaded ahead on the
background thread or on the training thread, and resumes bit for bit after a SIGKILL with every
window once per epoch; a batch() that fails stops the job with the team's own error (not a hang);
a dataset that augments with the global generators is loaded on the training thread, so that its
resume is bit for bit too; a missing file is one line and exit code 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.launch import Run, run_worker, write_spec
from tests.integration.worker.traces import assert_rng_continued, committed

pytestmark = pytest.mark.integration
SEQ = 16
WINDOWS = 200  # an epoch is 12 steps of 16 samples and a short one of 8


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("tokens")
    rng = np.random.default_rng(0)
    train, val = tmp / "train.bin", tmp / "val.bin"
    rng.integers(0, 97, WINDOWS * SEQ + 1).astype(np.uint16).tofile(train)
    rng.integers(0, 97, 20 * SEQ + 1).astype(np.uint16).tofile(val)
    return {"path": str(train), "eval_path": str(val)}


def token_spec(ck: Path, files: dict[str, str], **data: Any) -> dict[str, Any]:
    return {
        "name": "token-file",
        "model": {"name": "tiny-gpt", "kwargs": {"dropout": 0.1}},
        "data": {"name": "token-file", "dtype": "uint16", "seq_len": SEQ, **files, **data},
        "micro_batch_size": 4,
        "grad_accum_steps": 2,
        "max_steps": 24,
        "seed": 5,
        "deterministic": True,
        "log_every_steps": 4,
        "eval": {"every_steps": 12},
        "checkpoint": {"dir": str(ck), "interval_steps": 8},
    }


def train(tmp: Path, name: str, spec: dict[str, Any], *, kill: str | None = None, nproc: int = 2) -> Run:
    (tmp / f"{name}-trace").mkdir()
    env = {"ELASTRAIN_TRACE_SAMPLES": str(tmp / f"{name}-trace")}
    if kill:
        env["ELASTRAIN_FAILPOINTS"] = f"after_grad_sync=kill@{kill}^0"
    run = run_worker(write_spec(tmp, spec, f"{name}.json"), nproc=nproc, max_restarts=2, env=env)
    assert run.code == 0, run.stderr[-4000:]
    return run


def outcome(run: Run) -> tuple[Any, ...]:
    finished = run.last("finished")
    evals = {e["step"]: e["loss"] for e in run.all("eval")}  # after a resume: the newest attempt's
    return finished["params_digest"], finished["loss"], evals


def test_a_token_file_trains_the_same_bits_loaded_ahead_or_not_and_resumes_bit_for_bit(
    tmp_path: Path, files: dict[str, str]
) -> None:
    ahead = train(tmp_path, "ahead", token_spec(tmp_path / "ahead", files, prefetch=4))
    inline = train(tmp_path, "inline", token_spec(tmp_path / "inline", files, prefetch=0))
    assert outcome(ahead) == outcome(inline)
    assert ahead.last("finished")["samples_seen"] == 24 * 16 - 8  # one short window
    assert [e["samples"] for e in ahead.all("eval")] == [20, 20]
    seen = committed(tmp_path / "ahead-trace")
    assert set(seen.values()) == {1} and {i for e, i in seen if e == 0} == set(range(WINDOWS))
    killed = train(tmp_path, "killed", token_spec(tmp_path / "killed", files, prefetch=4), kill="1#13")
    resumed = killed.last("resumed")
    assert resumed["step"] == 8 and resumed["rng_restored"]
    assert_rng_continued(killed, tmp_path / "killed-trace", tmp_path / "ahead-trace", "token-file kill at 13")
    assert outcome(killed) == outcome(ahead)
    assert committed(tmp_path / "killed-trace") == seen  # the trace records what the steps trained on


def corrupt_spec(ck: Path, prefetch: int) -> dict[str, Any]:
    return {
        "name": "corrupt",
        "model": {"name": "mlp", "kwargs": {"hidden": 16}},
        "data": {
            "factory": "tests.integration.worker.data_factories:corrupt",
            "samples": 64,
            "kwargs": {"bad": 55},
            "prefetch": prefetch,
        },
        "micro_batch_size": 4,
        "grad_accum_steps": 2,
        "max_steps": 20,
        "log_every_steps": 1,
        "checkpoint": {"dir": str(ck), "interval_steps": 100},
    }


def test_a_failing_batch_stops_the_job_with_the_users_error_loaded_ahead_or_not(tmp_path: Path) -> None:
    """Sample 55 is at position 41 of seed 0's first epoch, in the third step (16 samples a step);
    the contract check before the group loaded samples 0-3 only, so the error comes from the
    training loop, on the rank that needs it, after two steps (when loaded ahead: while the second
    trains)."""
    last_steps = []
    for prefetch in (2, 0):
        spec = write_spec(tmp_path, corrupt_spec(tmp_path / f"ck{prefetch}", prefetch), f"c{prefetch}.json")
        run = run_worker(spec, nproc=2, timeout=120)
        assert run.code != 0 and run.code != 2, run.stderr[-3000:]
        assert "ValueError: sample 55 is corrupt (checksum mismatch in shard 3)" in run.stderr, run.stderr[
            -3000:
        ]
        last_steps.append(max((e["step"] for e in run.all("progress")), default=0))
    assert last_steps == [2, 2]


def augmented_spec(ck: Path) -> dict[str, Any]:
    return {
        "name": "augmented",
        "model": {"name": "mlp", "kwargs": {"hidden": 16, "dropout": 0.1}},
        "data": {"factory": "tests.integration.worker.data_factories:augmented", "samples": 256},
        "micro_batch_size": 4,
        "grad_accum_steps": 2,
        "max_steps": 24,
        "seed": 2,
        "deterministic": True,
        "checkpoint": {"dir": str(ck), "interval_steps": 8},
    }


def test_a_dataset_drawing_from_the_global_generators_is_loaded_inline_and_resumes_bit_for_bit(
    tmp_path: Path,
) -> None:
    ref = train(tmp_path, "ref", augmented_spec(tmp_path / "ref"))
    assert any(
        n.startswith("data.prefetch: batch() draws from the global") for n in ref.last("run_record")["notes"]
    )
    killed = train(tmp_path, "killed", augmented_spec(tmp_path / "killed"), kill="0#11")
    assert killed.last("resumed")["step"] == 8
    assert_rng_continued(killed, tmp_path / "killed-trace", tmp_path / "ref-trace", "augmented kill at 11")
    assert outcome(killed) == outcome(ref)


def test_a_missing_token_file_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    spec = token_spec(tmp_path / "ck", {"path": str(tmp_path / "nope.bin")})
    run = run_worker(write_spec(tmp_path, spec), nproc=0, timeout=120)
    assert run.code == 2, run.stderr[-2000:]
    line = run.stderr.strip().splitlines()
    assert len(line) == 1 and "field 'data.path': no file at" in line[0] and "nope.bin" in line[0], run.stderr
