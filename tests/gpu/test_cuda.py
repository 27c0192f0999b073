"""The worker's GPU paths, run as a user runs them: ``torchrun --standalone --nproc-per-node=1
-m worker`` on a machine with one CUDA GPU (NCCL chosen on its own, the model and the optimizer
on the device, AMP's scaler on real fp16 gradients, CUDA generators in the checkpoint).

Not part of ``make test``: the test machines have no GPU. ``make test-gpu`` runs these on one
that has; without a visible GPU every test fails saying so (it is not skipped). One GPU allows
one rank (NCCL refuses two ranks on one device), so these cover the device paths at W=1 and the
move of a checkpoint between the GPU and a CPU group of 2; what several GPUs add (NCCL's
all-reduce between ranks) is not covered here.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.launch import Run
from tests.integration.worker import test_resume as resume
from tests.integration.worker import test_user_model as user_model
from tests.integration.worker.test_service_e2e import Service, events_of, job_spec
from tests.integration.worker.traces import assert_rng_continued
from worker.checkpoint.verify import logical_digest

pytestmark = pytest.mark.integration
SEED = 1


@pytest.fixture(autouse=True)
def a_gpu() -> None:
    if torch.version.cuda is None:
        pytest.fail(
            f"tests/gpu needs a CUDA build of torch and this one is {torch.__version__}: install one "
            "into .venv (the README's Quick start) on a machine with a GPU"
        )
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA GPU and none is visible: run `make test-gpu` where there is one")


def gpu_run_record(run: Run) -> dict[str, Any]:
    record = run.last("run_record")
    assert record["device"] == "cuda:0" and record["backend"] == "nccl", record
    assert record["versions"]["cuda"], record["versions"]
    return record


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_job_trains_on_the_gpu_over_nccl(tmp_path: Path, precision: str) -> None:
    """``ddp.backend`` left at auto picks NCCL and the rank's GPU; the progress reports the CUDA
    allocator's peak, and the loss goes down."""
    run = resume.train(tmp_path, "run", nproc=1, precision=precision, max_steps=60)
    record = gpu_run_record(run)
    assert record["precision"] == precision
    progress = run.all("progress")
    peaks = [p["peak_memory_bytes"] for p in progress]
    assert all(0 < peak < torch.cuda.get_device_properties(0).total_memory for peak in peaks), peaks
    done = run.last("finished")
    assert done["step"] == 60 and done["skipped_steps"] == 0 and math.isfinite(done["loss"])
    assert progress[-1]["loss"] < progress[0]["loss"], [p["loss"] for p in progress]


def test_fp16_overflow_on_the_gpu_skips_steps_and_backs_the_scale_off(tmp_path: Path) -> None:
    """A loss scale far too large for fp16 (2^40): the gradients overflow for real, each such
    step is skipped (no update) and halves the scale, until the scaled gradients fit and the
    job trains on."""
    run = resume.train(
        tmp_path, "run", nproc=1, precision="fp16", max_steps=60, loss_scale={"init_scale": 2.0**40}
    )
    gpu_run_record(run)
    done = run.last("finished")
    assert 0 < done["skipped_steps"] < 60, done
    assert done["loss_scale"] == 2.0**40 / 2 ** done["skipped_steps"], done
    assert done["samples_seen"] == 60 * 16 and math.isfinite(done["loss"]), done


VARIANTS = [*resume.VARIANTS, "async"]


def variant_over(name: str, ck: Path) -> dict[str, Any]:
    """The CPU resume tests' variant ``name``, or async saves into ``ck``."""
    if name == "async":
        return {"checkpoint": {"dir": str(ck), "interval_steps": 10, "async": True}}
    return resume.VARIANTS[name]


@pytest.mark.parametrize("variant", VARIANTS)
def test_sigkill_resumes_bit_for_bit_on_the_gpu(
    tmp_path: Path, variant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The dropout model of the CPU resume tests (tests/integration/worker/test_resume.py) on the
    GPU: killed at a random step, restarted by torchrun and resumed from the newest checkpoint,
    it ends with the uninterrupted run's parameters and final checkpoint, bit for bit; its CUDA
    generators continue where the checkpoint left them."""
    skip = resume.FP16_SKIP if variant == "fp16" else {}
    ref = resume.train(
        tmp_path, "reference", nproc=1, trace=True, env=skip, **variant_over(variant, tmp_path / "reference")
    )
    hit = random.Random(SEED).randrange(12, 29)
    arm = f"after_grad_sync=kill@0#{hit}^0"
    env = {"ELASTRAIN_FAILPOINTS": ",".join(filter(None, [arm, skip.get("ELASTRAIN_FAILPOINTS")]))}
    over = variant_over(variant, tmp_path / "faulty")
    run = resume.train(tmp_path, "faulty", nproc=1, trace=True, env=env, **over)
    why = f"{variant} arm={arm}"
    gpu_run_record(run)
    resumed = run.last("resumed")
    assert resumed["rng_restored"], why
    assert_rng_continued(run, resume.trace_dir(run), resume.trace_dir(ref), why)
    assert run.last("finished")["params_digest"] == ref.last("finished")["params_digest"], why
    if variant == "fp16":
        assert run.last("finished")["skipped_steps"] == 1 and run.last("finished")["loss_scale"] == 32768.0
    final = tmp_path / "faulty" / "step-00000030"
    ref_final = tmp_path / "reference" / "step-00000030"
    assert resume.digest(final, capsys) == resume.digest(ref_final, capsys), why


def test_a_hugging_face_model_resumes_bit_for_bit_on_the_gpu(tmp_path: Path) -> None:
    """GPT-2 built from a config (tied embeddings, dropout) in bf16 on the GPU, killed and resumed."""
    ref = user_model.train(tmp_path, "reference", nproc=1, precision="bf16")
    hit = random.Random(SEED).randrange(10, 24)
    arm = f"after_grad_sync=kill@0#{hit}^0"
    run = user_model.train(tmp_path, "faulty", nproc=1, env={"ELASTRAIN_FAILPOINTS": arm}, precision="bf16")
    why = f"arm={arm}"
    gpu_run_record(run)
    assert run.last("resumed")["rng_restored"], why
    assert_rng_continued(run, tmp_path / "faulty-trace", tmp_path / "reference-trace", why)
    done, ref_done = run.last("finished"), ref.last("finished")
    assert done["params_digest"] == ref_done["params_digest"], why
    assert done["shared_params"] == user_model.TIED, "the tied weights came apart"
    assert logical_digest(tmp_path / "faulty") == logical_digest(tmp_path / "reference"), why


LAYER_NORM = {"name": "mlp", "kwargs": {"hidden": 32, "norm": "layer"}}


@pytest.mark.parametrize(("first", "then"), [("gpu", "cpu"), ("cpu", "gpu")])
def test_a_checkpoint_moves_between_the_gpu_and_a_cpu_group(tmp_path: Path, first: str, then: str) -> None:
    """Saved by one GPU rank and resumed by two CPU ranks (gloo), or the other way round: what the
    new group loaded, saved again before any step, is the saved state (its logical digest), and
    the resumed job trains on to the end on its own device."""

    def train(side: str, **over: Any) -> Run:
        if side == "gpu":
            return resume.train(tmp_path, "ck", nproc=1, model=LAYER_NORM, **over)
        return resume.train(tmp_path, "ck", nproc=2, model=LAYER_NORM, ddp={"backend": "gloo"}, **over)

    saved = train(first, max_steps=10)
    assert saved.last("run_record")["device"] == ("cuda:0" if first == "gpu" else "cpu")
    source = logical_digest(tmp_path / "ck" / "step-00000010")
    copy = {"ELASTRAIN_CHECKPOINT_COPY_ON_RESUME": str(tmp_path / "loaded")}
    run = train(then, max_steps=14, env=copy)
    assert run.last("run_record")["device"] == ("cuda:0" if then == "gpu" else "cpu")
    assert run.last("resumed")["step"] == 10
    assert run.last("checkpoint_copied")["published"] and logical_digest(tmp_path / "loaded") == source
    assert run.last("finished")["step"] == 14


def run_record(job: dict[str, Any]) -> dict[str, Any]:
    return events_of(Path(job["checkpoint_dir"]) / "events.jsonl", "run_record")[0]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    """``elastrain serve`` with the local scheduler, its embedded etcd, on this machine."""
    svc = Service(tmp_path / "svc", {})
    svc.data_dir.mkdir()
    svc.start()
    yield svc
    svc.stop()


def test_a_job_of_one_node_under_the_service_trains_on_the_gpu(service: Service) -> None:
    """``elastrain serve`` with the local scheduler: a job of one node (the default peer mode)
    keeps the machine's GPU, and its worker picks NCCL on it."""
    job = service.finished(service.submit(job_spec(nproc_per_node=1, max_steps=30)))
    assert job["state"] == "SUCCEEDED", job
    record = run_record(job)
    assert (record["device"], record["backend"]) == ("cuda:0", "nccl"), record
    submitted = job["events"][0]["message"]
    assert "on CPU" not in submitted, submitted


def test_a_job_of_two_nodes_under_the_service_trains_on_cpu_and_says_why(service: Service) -> None:
    """Two nodes on one machine cannot each have a GPU of their own here (NCCL refuses two ranks
    on one GPU): the service keeps the GPUs from them, the job trains on CPU and its submitted
    event says why; NCCL asked for by name is refused at submit."""
    job = service.finished(service.submit(job_spec(nodes="2", nproc_per_node=1, max_steps=30)))
    assert job["state"] == "SUCCEEDED", job
    record = run_record(job)
    assert (record["device"], record["backend"]) == ("cpu", "gloo"), record
    submitted = job["events"][0]["message"]
    assert "on CPU (gloo): the local scheduler runs this job's 2 node apps on one machine" in submitted
    refused = service.http.post(
        "/v1/jobs", json=job_spec(nodes="2", nproc_per_node=1, ddp={"backend": "nccl"})
    )
    assert refused.status_code == 422 and "ddp.backend" in refused.text, refused.text
