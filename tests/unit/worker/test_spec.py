"""The JobSpec accepts the documented example as written and names the field on bad input."""

from __future__ import annotations

import json

import pytest

from worker.errors import SpecError
from worker.jobspec.spec import parse_nodes, parse_spec

EXAMPLE = (
    '{"name": "demo", "model": {"name": "mlp"}, "data": {"name": "synthetic", "samples": 2048}, '
    '"precision": "fp16", "micro_batch_size": 8, "grad_accum_steps": 2, "max_steps": 30, "seed": 3, '
    '"deterministic": true, "checkpoint": {"dir": "/some/dir", "interval_steps": 10}}'
)


def test_documented_example_is_accepted() -> None:
    spec = parse_spec(EXAMPLE)
    assert spec.precision == "fp16" and spec.grad_accum_steps == 2
    assert spec.checkpoint.interval_steps == 10 and spec.checkpoint.retention.keep_latest >= 2


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"micro_batch_size": "8"}, "micro_batch_size"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"max_steps": -1}, "max_steps"),
        ({"typo_field": 1}, "typo_field"),
        ({"model": {"name": "resnet"}}, "model.name"),
        ({"precision": "fp8"}, "precision"),
        ({"checkpoint": {"retention": {"keep_latest": 1}}}, "checkpoint.retention.keep_latest"),
        ({"model": {"factory": "no colon"}}, "model.factory"),
        ({"nodes": "3:1"}, "nodes"),
    ],
)
def test_bad_input_names_the_field(change: dict[str, object], field: str) -> None:
    raw = json.loads(EXAMPLE) | change
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    assert f"'{field}" in str(info.value)


def test_both_batch_forms_is_refused() -> None:
    raw = json.loads(EXAMPLE) | {"global_batch_size": 32}
    with pytest.raises(SpecError, match="only one of 'grad_accum_steps' or 'global_batch_size'"):
        parse_spec(raw)


def test_malformed_json_says_so() -> None:
    with pytest.raises(SpecError, match="JSON"):
        parse_spec("{")


def test_nodes_forms() -> None:
    assert parse_nodes("2") == (2, 2)
    assert parse_nodes("1:4") == (1, 4)


@pytest.mark.parametrize("nested", [{"n_layer": 2}, [1, 2], None])
def test_nested_kwargs_get_one_message_that_says_values_are_scalars(nested: object) -> None:
    raw = json.loads(EXAMPLE) | {
        "model": {"factory": "team.models:build", "kwargs": {"config": nested, "n": 2}}
    }
    with pytest.raises(SpecError) as info:
        parse_spec(raw)
    message = str(info.value)
    assert message.startswith("field 'model.kwargs.config': values must be scalars")
    assert "flat keys" in message and ".str'" not in message and message.count("field '") == 1


def test_data_samples_defaults_to_the_datasets_own_length() -> None:
    raw = json.loads(EXAMPLE)
    raw["data"] = {"factory": "team.data:build"}
    assert parse_spec(raw).data.samples is None


@pytest.mark.parametrize("output", ["auto", "logits", "loss", "scores", 0, 2])
def test_model_output_takes_a_name_or_an_index(output: object) -> None:
    raw = json.loads(EXAMPLE) | {"model": {"name": "mlp", "output": output}}
    assert parse_spec(raw).model.output == output


@pytest.mark.parametrize("output", [-1, True, "", 1.5])
def test_a_bad_model_output_says_what_it_takes(output: object) -> None:
    raw = json.loads(EXAMPLE) | {"model": {"name": "mlp", "output": output}}
    with pytest.raises(SpecError, match=r"^field 'model.output': give 'auto', 'logits', 'loss'"):
        parse_spec(raw)


def test_a_loss_factory_and_the_models_own_loss_exclude_each_other() -> None:
    raw = json.loads(EXAMPLE) | {"loss": {"factory": "team.losses:ce", "kwargs": {"reduction": "none"}}}
    assert parse_spec(raw).loss is not None
    raw["model"] = {"name": "mlp", "output": "loss"}
    with pytest.raises(SpecError, match=r"^field 'loss': give either model.output 'loss'"):
        parse_spec(raw)
