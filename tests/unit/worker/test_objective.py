"""A user's model as it comes: the output the worker picks, and per-sample losses (plain values)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.nn import functional

from worker.datapath.datasets import loss_sum
from worker.errors import SpecError
from worker.train.objective import Objective, describe, per_sample

LOGITS = torch.randn(4, 5, 7, generator=torch.Generator().manual_seed(0))
TARGETS = torch.randint(0, 7, (4, 5), generator=torch.Generator().manual_seed(1))


@dataclass
class WithLogits:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


def token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1), reduction="none").view(4, 5)


def mean_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))


@pytest.mark.parametrize(
    ("output", "choice"),
    [
        (LOGITS, "auto"),
        ((LOGITS, "cache"), "auto"),
        ({"logits": LOGITS, "hidden": 1}, "auto"),
        (WithLogits(LOGITS), "auto"),
        ({"scores": LOGITS}, "scores"),
        (("cache", LOGITS), 1),
        (WithLogits(LOGITS), "logits"),
    ],
)
def test_every_output_form_gives_the_same_loss_as_a_plain_tensor(output: object, choice: str | int) -> None:
    objective = Objective(output=choice, task="lm")
    assert torch.equal(objective.loss_sum(output, TARGETS), loss_sum("lm", LOGITS, TARGETS))


def test_a_hugging_face_model_output_is_taken_as_it_comes() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    out = CausalLMOutputWithCrossAttentions(logits=LOGITS)
    assert torch.equal(Objective(task="lm").loss_sum(out, TARGETS), loss_sum("lm", LOGITS, TARGETS))


def test_an_output_without_what_was_asked_says_what_it_is_and_how_to_choose() -> None:
    with pytest.raises(SpecError) as info:
        Objective(task="lm").loss_sum({"scores": LOGITS, "aux": LOGITS}, TARGETS)
    message = str(info.value)
    assert message.startswith("field 'model.output'")
    assert "dict with keys ['scores', 'aux']" in message and "set model.output" in message
    with pytest.raises(SpecError, match="no element 3"):
        Objective(output=3, task="lm").loss_sum((LOGITS,), TARGETS)
    with pytest.raises(SpecError, match=r"^field 'model.output': 'scores' cannot pick .* a tensor"):
        Objective(output="scores", task="lm").loss_sum(LOGITS, TARGETS)  # a built-in model's plain tensor


def test_the_models_own_loss_needs_the_targets_in_the_inputs() -> None:
    with pytest.raises(SpecError, match="labels"):
        Objective(output="loss").loss_sum(WithLogits(LOGITS), TARGETS)


def test_a_user_loss_of_per_token_losses_weighs_like_the_built_in_lm_loss() -> None:
    objective = Objective(task="anything", loss=token_ce, loss_name="m:token_ce")
    assert torch.equal(objective.loss_sum(LOGITS, TARGETS), loss_sum("lm", LOGITS, TARGETS))


def test_a_user_loss_gets_its_kwargs_and_fp32_predictions() -> None:
    seen = {}

    def loss(out: torch.Tensor, targets: torch.Tensor, *, weight: float) -> torch.Tensor:
        seen["dtype"] = out.dtype
        return token_ce(out, targets) * weight

    objective = Objective(loss=loss, loss_kwargs={"weight": 2.0}, output="logits")
    total = objective.loss_sum({"logits": LOGITS.bfloat16()}, TARGETS)
    assert seen["dtype"] == torch.float32
    torch.testing.assert_close(total, 2 * loss_sum("lm", LOGITS.bfloat16().float(), TARGETS))


def test_a_mean_loss_is_refused_with_why_and_the_fix() -> None:
    objective = Objective(task="lm", loss=mean_ce, loss_name="team.losses:mean_ce")
    with pytest.raises(SpecError) as info:
        objective.loss_sum(LOGITS, TARGETS)
    message = str(info.value)
    assert message.startswith("field 'loss.factory': team.losses:mean_ce returned a scalar")
    assert "mean of means" in message and 'reduction="none"' in message


def test_a_models_mean_loss_is_refused_too() -> None:
    with pytest.raises(SpecError, match=r"field 'model.output'.*reduction=\"none\""):
        Objective(output="loss").loss_sum(WithLogits(LOGITS, loss=LOGITS.mean()), TARGETS)


def test_per_sample_losses_the_model_computed_are_summed() -> None:
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert Objective(output="loss").loss_sum({"loss": losses}, TARGETS).item() == 10.0


def test_losses_not_one_per_sample_are_refused() -> None:
    flat = torch.ones(20)  # per token, flattened: 20 rows for 4 samples
    with pytest.raises(SpecError, match=r"shape \(20,\) \(float32\) for a micro-batch of 4 samples"):
        per_sample(flat, field="loss.factory", what="m:f returned", rows=4)


def test_without_a_loss_the_task_must_be_a_built_in_one() -> None:
    with pytest.raises(ValueError, match="task"):
        Objective(task="causal-lm")
    Objective(task="causal-lm", output="loss")  # the model's own loss needs no task


def test_describe_names_shapes_and_keys() -> None:
    assert describe(LOGITS) == "a tensor of shape (4, 5, 7) (float32)"
    assert describe((LOGITS, None)) == "a tuple of 2: [a tensor of shape (4, 5, 7) (float32), None]"
    assert describe(WithLogits(LOGITS)) == "WithLogits with logits, loss"
