"""Data factories: their own length when data.samples is unset, refusals that name the fix."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from worker.datapath.datasets import DEFAULT_SAMPLES, build_data
from worker.errors import SpecError
from worker.jobspec.spec import DataSpec, ModelSpec
from worker.start.models import build_model

FILE_FACTORY = "tests.integration.worker.user_models:file_tokens"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).__mod__(50).astype(np.uint16).tofile(path)
    return path


def test_a_factory_covering_a_file_runs_on_its_own_length(token_file: Path) -> None:
    data = build_data(DataSpec(factory=FILE_FACTORY, kwargs={"path": str(token_file), "seq_len": 10}), seed=0)
    assert len(data) == 99  # (1000 - 1) // 10 windows


def test_a_given_sample_count_must_match_and_says_how_to_let_it_follow(token_file: Path) -> None:
    spec = DataSpec(factory=FILE_FACTORY, samples=4096, kwargs={"path": str(token_file), "seq_len": 10})
    with pytest.raises(
        SpecError, match=r"^field 'data.samples': the factory returned 99 samples, not 4096; leave"
    ):
        build_data(spec, seed=0)


def test_the_built_ins_generate_their_default_count() -> None:
    assert len(build_data(DataSpec(name="synthetic"), seed=0)) == DEFAULT_SAMPLES
    assert len(build_data(DataSpec(name="tokens", samples=64), seed=0)) == 64


@pytest.mark.parametrize("name", ["mlp", "tiny-gpt"])
def test_the_built_in_models_take_a_dropout_off_by_default(name: str) -> None:
    meta = {"input_dim": 4, "output_dim": 2, "vocab_size": 8, "seq_len": 4}
    assert not any(
        m.__class__.__name__ == "Dropout" for m in build_model(ModelSpec(name=name), meta).modules()
    )
    on = build_model(ModelSpec(name=name, kwargs={"dropout": 0.1}), meta)
    assert any(m.__class__.__name__ == "Dropout" for m in on.modules())
    with pytest.raises(SpecError, match="dropout must be at least 0 and below 1"):
        build_model(ModelSpec(name=name, kwargs={"dropout": 1.0}), meta)
