"""Tied weights under real torchrun (gloo, CPU) with FSDP2: a ``transformers`` GPT-2 (2 layers,
tied embeddings, dropout) saved at W=2 stores the tie once, resumes bit for bit at W=2, and
loads at W'=1 and 3 (FSDP and DDP) with the head still the embedding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.checkpoint.harness import Run, torchrun
from worker.checkpoint.layout import load_manifest
from worker.checkpoint.verify import logical_digest

pytestmark = pytest.mark.integration
GPT2 = ("--model", "gpt2", "--parallelism", "fsdp", "--every", "2", "--seed", "4")
WTE, HEAD = "model.transformer.wte.weight", "model.lm_head.weight"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    d = tmp_path_factory.mktemp("tied") / "ref"
    return d, torchrun(2, "--dir", str(d), "--steps", "6", *GPT2).check()


def test_the_tie_is_stored_once_and_survives_training(reference: tuple[Path, Run]) -> None:
    d, run = reference
    assert run.last("finished")["tied"] is True
    m = load_manifest(d / "step-00000006")
    assert m.aliases == {HEAD: WTE} and HEAD not in m.tensors and m.tensors[WTE].kind == "sharded"
    assert not [n for n in m.tensors if n.startswith("optim.state.lm_head")]


def test_resume_at_the_same_world_size_is_bitwise(reference: tuple[Path, Run], tmp_path: Path) -> None:
    d = tmp_path / "resumed"
    torchrun(2, "--dir", str(d), "--steps", "4", *GPT2).check()
    again = torchrun(2, "--dir", str(d), "--steps", "6", *GPT2).check()
    assert again.last("resumed")["step"] == 4 and again.last("finished")["tied"] is True
    assert again.last("finished")["digest"] == reference[1].last("finished")["digest"]


@pytest.mark.parametrize("world", [1, 3])
def test_load_at_another_world_size_re_ties(reference: tuple[Path, Run], tmp_path: Path, world: int) -> None:
    src, run = reference
    jobs = [["fsdp", str(src), str(tmp_path / "fsdp")], ["ddp", str(src), str(tmp_path / "ddp")]]
    out = torchrun(world, "--phase", "resave", "--jobs", json.dumps(jobs), *GPT2).check()
    digest = run.last("finished")["digest"]
    for parallelism in ("fsdp", "ddp"):
        (resaved,) = [e for e in out.all("resaved") if e["parallelism"] == parallelism]
        assert resaved["tied"] is True and resaved["digest"] == digest, parallelism
        assert logical_digest(tmp_path / parallelism) == digest
    assert all(e["finite"] for e in out.all("continued"))
