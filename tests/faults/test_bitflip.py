"""A silent corruption in one DDP replica is caught, named and trained away (fault row
``bitflip-replica``).

The team's model (``tests.integration.worker.bitflip``) flips one bit of one weight on one
rank at a seeded step, once per run. Under the README's bare torchrun command (two processes,
``--max-restarts 1``) the replicas compare their state every 4 steps and before each save: the
check after the flip names the step, both ranks (two replicas: neither is trusted over the
other) and the tensor; nothing is saved while they disagree; torchrun's restart resumes from the
newest published checkpoint (saved before the flip, when they agreed) and trains the steps since
again (``elastrain report`` calls that restart ``replica_mismatch``); the run ends with the
undisturbed run's state digest, and every checkpoint it published is the undisturbed run's at
that step.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from service.report import build_report, load_run
from tests.integration.launch import Run, run_worker, write_spec
from tests.integration.worker.test_resume import spec
from tests.seeds import seeded
from worker.checkpoint.verify import logical_digest

pytestmark = [pytest.mark.faults, pytest.mark.integration]
MODEL = "tests.integration.worker.bitflip:mlp"
STEPS, EVERY, SAVE = 20, 4, 10


def flip_spec(ck: Path, **kwargs: Any) -> dict[str, Any]:
    model = {"factory": MODEL, "kwargs": {"hidden": 32, "norm": "batch", "dropout": 0.1, **kwargs}}
    return spec(
        ck, max_steps=STEPS, model=model, integrity={"every_steps": EVERY},
        checkpoint={"dir": str(ck), "interval_steps": SAVE},
    )  # fmt: skip


def train(tmp: Path, name: str, **kwargs: Any) -> Run:
    path = write_spec(tmp, flip_spec(tmp / name, **kwargs), f"{name}.json")
    run = run_worker(path, nproc=2, max_restarts=1)
    assert run.code == 0, run.stderr[-4000:]
    return run


def published(ck: Path) -> dict[int, str]:
    return {int(p.name.removeprefix("step-")): logical_digest(p) for p in sorted(ck.glob("step-*"))}


@seeded
def test_a_flipped_bit_in_one_replica_is_named_and_trained_away(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    rank, step = rng.randrange(2), rng.randrange(SAVE + 1, 2 * SAVE)  # between two saves
    tensor = rng.choice(["net.0.weight", "net.1.weight", "net.4.bias"])
    why = f"seed={seed}: rank {rank} flips a bit of {tensor} in step {step}"
    reference = train(tmp_path, "reference")
    assert not reference.all("replica_mismatch"), why
    run = train(
        tmp_path, "flipped", flip_rank=rank, flip_call=2 * step - 1, flip_tensor=tensor,
        marker=str(tmp_path / "flipped.marker"),
    )  # fmt: skip
    assert (tmp_path / "flipped.marker").exists(), why
    [caught] = run.all("replica_mismatch")
    assert step <= caught["step"] <= 2 * SAVE, why
    assert caught["ranks"] == [0, 1], why
    assert caught["tensors"] == [tensor], why  # the weight itself: its gradients were all-reduced
    assert "replicas disagree" in run.stderr, why
    assert run.last("resumed")["step"] == SAVE, why  # the newest checkpoint saved before the flip
    (restart,) = build_report(load_run(tmp_path / "flipped"))["restarts"]  # `elastrain report`
    assert restart["kind"] == "replica_mismatch" and restart["resumed_step"] == SAVE, why
    assert run.last("finished")["params_digest"] == reference.last("finished")["params_digest"], why
    ref = published(tmp_path / "reference")
    assert published(tmp_path / "flipped") == {s: ref[s] for s in published(tmp_path / "flipped")}, why
    assert STEPS in ref, why
