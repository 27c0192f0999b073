"""A team's own model, as it comes: a Hugging Face ``GPT2LMHeadModel`` built from a config (two
layers, tied embeddings, dropout 0.1; no download), reached through the factory path a user's
code takes (``tests.integration.worker.user_models``, importable from the working directory the
worker starts in, as a team's package would be), under torchrun on CPU/gloo.

Its forward returns a ``CausalLMOutputWithCrossAttentions``; the worker picks ``logits`` from it.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.integration.launch import Run, run_worker, write_spec
from tests.integration.worker.traces import assert_rng_continued, committed
from worker.checkpoint.verify import logical_digest

pytestmark = pytest.mark.integration
SEEDS = [int(s) for s in os.environ.get("ELASTRAIN_FAULT_SEEDS", "1").split(",")]
MODELS = "tests.integration.worker.user_models"
TIED = [["lm_head.weight", "transformer.wte.weight"]]
SAMPLES = 384  # one epoch = 24 steps of 16


def spec(ck: Path, **over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "gpt2",
        "model": {"factory": f"{MODELS}:gpt2"},
        "data": {"name": "tokens", "samples": SAMPLES, "kwargs": {"vocab_size": 32, "seq_len": 16}},
        "micro_batch_size": 8,
        "global_batch_size": 16,
        "max_steps": 24,
        "seed": 7,
        "deterministic": True,
        "log_every_steps": 8,
        "optimizer": {"lr": 0.003, "weight_decay": 0.01},
        "checkpoint": {"dir": str(ck), "interval_steps": 8},
    }
    return base | over


def train(tmp: Path, name: str, *, nproc: int = 2, env: dict[str, str] | None = None, **over: Any) -> Run:
    trace = tmp / f"{name}-trace"
    trace.mkdir(exist_ok=True)
    env = {"ELASTRAIN_TRACE_SAMPLES": str(trace)} | (env or {})
    path = write_spec(tmp, spec(tmp / name, **over), f"{name}.json")
    run = run_worker(path, nproc=nproc, max_restarts=2, env=env)
    assert run.code == 0, run.stderr[-4000:]
    return run


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    tmp = tmp_path_factory.mktemp("gpt2")
    return tmp, train(tmp, "reference")


@pytest.mark.parametrize("seed", SEEDS)
def test_sigkill_resumes_bit_for_bit_with_a_per_sample_user_loss(
    tmp_path: Path, reference: tuple[Path, Run], seed: int
) -> None:
    """The faulty run also computes its loss with the team's own per-token cross-entropy
    (``reduction="none"``) on ``logits``: weighted per sample like the built-in ``lm`` loss the
    reference uses, it must train bit for bit the same."""
    rng = random.Random(seed)
    rank, hit = rng.randrange(2), rng.randrange(10, 24)
    arm = f"after_grad_sync=kill@{rank}#{hit}^0"
    run = train(
        tmp_path, "faulty", env={"ELASTRAIN_FAILPOINTS": arm},
        model={"factory": f"{MODELS}:gpt2", "output": "logits"}, loss={"factory": f"{MODELS}:token_ce"},
    )  # fmt: skip
    ref_tmp, ref = reference
    why = f"seed={seed} arm={arm}"
    resumed = run.last("resumed")
    assert resumed["step"] in (8, 16) and resumed["rng_restored"], why
    assert_rng_continued(run, tmp_path / "faulty-trace", ref_tmp / "reference-trace", why)
    done, ref_done = run.last("finished"), ref.last("finished")
    assert done["params_digest"] == ref_done["params_digest"], why
    assert done["shared_params"] == ref_done["shared_params"] == TIED, "the tied weights came apart"
    assert logical_digest(tmp_path / "faulty") == logical_digest(ref_tmp / "reference"), why
    assert run.last("run_record")["loss"] == f"the loss factory {MODELS}:token_ce"


def test_reshard_two_to_one_sees_every_sample_once_and_keeps_the_tie(tmp_path: Path) -> None:
    first = train(tmp_path, "ck", max_steps=12)
    assert first.last("checkpoint_published")["step"] == 12
    source = logical_digest(tmp_path / "ck" / "step-00000012")
    run = train(
        tmp_path, "ck", nproc=1, env={"ELASTRAIN_CHECKPOINT_COPY_ON_RESUME": str(tmp_path / "loaded")}
    )
    # what one rank loaded from two, saved again before any step: the same logical state
    assert run.last("checkpoint_copied")["published"] and logical_digest(tmp_path / "loaded") == source
    resumed = run.last("resumed")
    assert resumed["step"] == 12 and resumed["batch_plan"]["world_size"] == 1
    assert resumed["batch_plan"]["accum_steps"] == 2  # the global batch of 16 is kept
    done = run.last("finished")
    assert done["step"] == 24 and done["samples_seen"] == SAMPLES
    assert done["shared_params"] == TIED, "the tied weights came apart in the reshard"
    seen = committed(tmp_path / "ck-trace")
    assert seen == Counter({(0, i): 1 for i in range(SAMPLES)}), "a sample was loaded twice or never"


def test_inputs_as_keyword_arguments_with_the_teams_loss(tmp_path: Path) -> None:
    """Hugging Face style data: the inputs are a mapping (``input_ids``, ``labels``) passed as
    keyword arguments, its task is not a built-in one, and the team's loss reads ``logits``."""
    keywords = spec(
        tmp_path / "kw",
        max_steps=3,
        global_batch_size=None,
        data={"factory": f"{MODELS}:labelled"},
        model={"factory": f"{MODELS}:gpt2", "output": "logits"},
        loss={"factory": f"{MODELS}:token_ce"},
    )
    run = run_worker(write_spec(tmp_path, keywords))
    assert run.code == 0, run.stderr[-3000:]
    assert run.last("finished")["step"] == 3
    assert run.last("run_record")["spec"]["data"]["samples"] is None  # the dataset's own length


@pytest.mark.parametrize(
    ("over", "start", "says"),
    [
        (
            {
                "loss": {"factory": f"{MODELS}:mean_ce"},
                "model": {"factory": f"{MODELS}:gpt2", "output": "logits"},
            },
            f"field 'loss.factory': {MODELS}:mean_ce returned a scalar",
            'reduction="none"',
        ),
        (
            {
                "data": {"factory": f"{MODELS}:labelled"},
                "model": {"factory": f"{MODELS}:gpt2", "output": "loss"},
            },
            "field 'model.output': the forward's 'loss' is a scalar",
            "mean of means",
        ),
        (
            {"model": {"factory": f"{MODELS}:gpt2", "output": "hidden_states"}},
            "field 'model.output': 'hidden_states' cannot pick from what the forward returned, "
            "CausalLMOutputWithCrossAttentions with keys ['logits']",
            "needs a tensor of logits (batch, sequence, vocabulary)",
        ),
    ],
)
def test_a_contract_the_worker_cannot_keep_is_one_line_and_exit_2(
    tmp_path: Path, over: dict[str, Any], start: str, says: str
) -> None:
    run = run_worker(write_spec(tmp_path, spec(tmp_path / "ck", global_batch_size=None, **over)))
    assert run.code == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    assert lines[0].startswith(f"elastrain worker: error: {start}"), lines[0]
    assert says in lines[0]
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").glob("step-*"))
