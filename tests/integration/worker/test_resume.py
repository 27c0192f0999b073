"""Resume with the real worker under torchrun: bit for bit after a kill (sync and async saves)
and at a new world size with every sample once. A corrupt newest checkpoint and ENOSPC during a
save are fault-matrix rows (tests/faults/test_worker_faults.py), which run in ``make test`` too.

The model draws from the RNG in training (dropout), so a resumed run is equal only if it continues
the very generator streams: the trace (ELASTRAIN_TRACE_SAMPLES, worker.datapath.trace) fingerprints every
generator right before each window, and the first window after a resume must start from the state
the checkpoint holds, which is the uninterrupted run's state at that step.

Fault tests are parametrised by seed (ELASTRAIN_FAULT_SEEDS="1,2,3" for more) and print the seed
on failure.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from service.cli import main as elastrain
from tests.integration.launch import Run, run_worker, write_spec
from tests.integration.worker.traces import assert_rng_continued
from worker.checkpoint.verify import logical_digest

pytestmark = pytest.mark.integration
SEEDS = [int(s) for s in os.environ.get("ELASTRAIN_FAULT_SEEDS", "1").split(",")]
FAILPOINTS = [
    "after_shard_write",
    "before_report",
    "before_manifest_write",
    "before_publish_rename",
    "after_publish_rename",
    "before_latest_update",
]


def spec(ck: Path, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "resume",
        "model": {"name": "mlp", "kwargs": {"hidden": 32, "norm": "batch", "dropout": 0.1}},
        "data": {"name": "synthetic", "samples": 512},
        "micro_batch_size": 8,
        "grad_accum_steps": 2,
        "max_steps": 30,
        "seed": 3,
        "deterministic": True,
        "log_every_steps": 10,
        "checkpoint": {"dir": str(ck), "interval_steps": 10},
    }
    return base | over


def digest(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert elastrain(["checkpoint", "digest", str(path)]) == 0
    return capsys.readouterr().out.split()[0]


def train(
    tmp: Path,
    name: str,
    *,
    nproc: int = 2,
    env: dict[str, str] | None = None,
    trace: bool = False,
    **over: Any,
) -> Run:
    ck = tmp / name
    env = dict(env or {})
    if trace:
        (tmp / f"{name}-trace").mkdir(exist_ok=True)
        env["ELASTRAIN_TRACE_SAMPLES"] = str(tmp / f"{name}-trace")
    run = run_worker(write_spec(tmp, spec(ck, **over), f"{name}.json"), nproc=nproc, max_restarts=2, env=env)
    assert run.code == 0, run.stderr[-4000:]
    return run


# fp16 with one skipped step early (scale backs off at step 3): the resumed run must carry the
# changed scale. The skip is armed in attempt 0 only, so a restart does not re-inject it.
FP16_SKIP = {"ELASTRAIN_FAILPOINTS": "after_grad_sync=nonfinite@0#3^0"}
# FSDP keeps each rank's BatchNorm statistics (see the README): its variant uses layer norm.
LAYER_NORM = {"name": "mlp", "kwargs": {"hidden": 32, "norm": "layer", "dropout": 0.1}}
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp16": {"precision": "fp16"},
    "bf16": {"precision": "bf16"},
    "fsdp": {"parallelism": "fsdp", "model": LAYER_NORM},
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("reference")
    return {
        name: train(tmp, name, trace=True, env=FP16_SKIP if name == "fp16" else None, **over)
        for name, over in VARIANTS.items()
    }


def trace_dir(run: Run) -> Path:
    """Where ``train(..., trace=True)`` put the run's trace: beside its checkpoint directory."""
    ck = Path(run.last("run_record")["spec"]["checkpoint"]["dir"])
    return ck.parent / f"{ck.name}-trace"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sigkill_of_a_rank_resumes_bit_for_bit(
    tmp_path: Path, reference: dict[str, Run], variant: str, seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    rng = random.Random(seed)
    rank, hit = rng.randrange(2), rng.randrange(12, 29)
    arm = f"after_grad_sync=kill@{rank}#{hit}^0"
    env = {
        "ELASTRAIN_FAILPOINTS": arm + ("," + FP16_SKIP["ELASTRAIN_FAILPOINTS"] if variant == "fp16" else "")
    }
    run = train(tmp_path, "faulty", env=env, trace=True, **VARIANTS[variant])
    ref = reference[variant]
    why = f"{variant} seed={seed} arm={arm}"
    resumed = run.last("resumed")
    newest_published = max(e["step"] for e in run.before_last("checkpoint_published", "resumed"))
    assert resumed["step"] == newest_published and resumed["rng_restored"], why
    assert_rng_continued(run, trace_dir(run), trace_dir(ref), why)
    assert run.last("finished")["params_digest"] == ref.last("finished")["params_digest"], why
    if variant == "fp16":
        assert run.last("finished")["skipped_steps"] == 1 and run.last("finished")["loss_scale"] == 32768.0
    # FSDP holds no replicas to compare, and the run record says so
    compared = not any(n.startswith("integrity: FSDP") for n in run.last("run_record")["notes"])
    assert compared == (variant != "fsdp"), why
    final = tmp_path / "faulty" / "step-00000030"
    assert digest(final, capsys) == digest(Path(ref.last("checkpoint_published")["path"]), capsys), why


def consumed(trace: Path) -> Counter[int]:
    """Every dataset index the ranks' data paths loaded (worker.datapath.trace records at batch())."""
    seen: Counter[int] = Counter()
    for path in trace.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert record["epoch"] == 0
            seen.update(record["indices"])
    return seen


@pytest.mark.parametrize(("parallelism", "world", "steps"), [("ddp", 1, 22), ("ddp", 3, 14), ("fsdp", 3, 14)])
def test_resume_at_a_new_world_size_sees_every_sample_once(
    tmp_path: Path, parallelism: str, world: int, steps: int
) -> None:
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {"ELASTRAIN_TRACE_SAMPLES": str(trace)}
    model = {"name": "mlp", "kwargs": {"hidden": 32, "norm": "layer"}}
    train(
        tmp_path, "ck", max_steps=10, env=env, parallelism=parallelism, model=model
    )  # 10 x 32 samples at W=2
    source = logical_digest(tmp_path / "ck" / "step-00000010")
    # The state the new world size loaded, saved again right after the load (before any step):
    # every tensor in its place gives the source's logical digest.
    copy = {"ELASTRAIN_CHECKPOINT_COPY_ON_RESUME": str(tmp_path / "loaded")}
    run = train(
        tmp_path, "ck", nproc=world, max_steps=steps, env=env | copy, parallelism=parallelism, model=model
    )
    resumed = run.last("resumed")
    assert resumed["step"] == 10 and resumed["batch_plan"]["world_size"] == world
    assert run.last("checkpoint_copied")["published"], "the loaded state was not saved again"
    loaded = json.loads((tmp_path / "loaded" / "step-00000010" / "manifest.json").read_text())
    assert loaded["world_size"] == world and logical_digest(tmp_path / "loaded") == source
    assert consumed(trace) == Counter(range(512))
    assert run.last("finished")["samples_seen"] == 512


@pytest.mark.parametrize("seed", SEEDS)
def test_async_checkpoints_resume_bit_for_bit(
    tmp_path: Path, reference: dict[str, Run], seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Async saves (the snapshot is copied while the next step's forward/backward runs, fenced
    before its optimizer step) hold exactly the sync run's state: a SIGKILLed run resumed from
    them ends bit for bit where the uninterrupted sync-checkpointed run ends. The kill comes
    after step 20's save began, which waits for step 10's to be published (one in flight)."""
    rng = random.Random(seed)
    rank, hit = rng.randrange(2), rng.randrange(21, 29)
    arm = f"after_grad_sync=kill@{rank}#{hit}^0"
    ck = tmp_path / "async"
    run = train(
        tmp_path, "async", env={"ELASTRAIN_FAILPOINTS": arm},
        checkpoint={"dir": str(ck), "interval_steps": 10, "async": True},
    )  # fmt: skip
    ref = reference["fp32"]
    resumed = run.last("resumed")
    published_before = [e["step"] for e in run.before_last("checkpoint_published", "resumed")]
    # step 20's publish may have happened on the writer thread just before the kill, unlogged
    assert resumed["step"] in (10, 20) and resumed["step"] >= max(published_before), f"seed={seed} arm={arm}"
    assert all(e["background"] for e in run.all("checkpoint_published"))
    assert run.last("finished")["params_digest"] == ref.last("finished")["params_digest"], f"seed={seed}"
    ref_final = Path(ref.last("checkpoint_published")["path"])
    assert digest(ck / "step-00000030", capsys) == digest(ref_final, capsys), f"seed={seed}"
    assert digest(ck / "step-00000010", capsys) == digest(ref_final.parent / "step-00000010", capsys)
