"""Weights people can load elsewhere: ``export-weights`` writes safetensors
through the ``safetensors`` package (or a torch state dict), in the dtype asked for, tied weights
once, a wrapper prefix stripped, and the Hugging Face ``config.json`` the checkpoint carries, so
``from_pretrained(DST)`` gives the same logits. Real ``transformers`` GPT-2, no download."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from torch import nn

from service.cli import main as cli_main
from tests.unit.checkpoint.helpers import checkpointer, save
from tests.unit.checkpoint.test_tied import gpt2, step
from worker.checkpoint.export import convert, export_weights
from worker.checkpoint.layout import load_manifest
from worker.errors import CheckpointError

IDS = torch.arange(12).reshape(1, 12) % 64


def logits(model: nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=IDS).logits
    return out


@pytest.fixture
def trained(tmp_path: Path) -> tuple[nn.Module, Path]:
    model, optim = gpt2()
    step(model, optim, 2)
    save(checkpointer(tmp_path / "job"), model, optim, 2)
    return model, tmp_path / "job"


def test_a_checkpoint_carries_the_hugging_face_config(trained: tuple[nn.Module, Path]) -> None:
    _, job = trained
    hf = load_manifest(job / "step-00000002").meta["hf"]
    assert hf["prefix"] == "" and hf["architectures"] == ["GPT2LMHeadModel"]
    assert hf["config"]["model_type"] == "gpt2" and hf["config"]["n_layer"] == 2


def test_from_pretrained_loads_the_export_with_the_same_logits(
    trained: tuple[nn.Module, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model, job = trained
    result = export_weights(job, tmp_path / "out")
    assert result.path == tmp_path / "out" / "model.safetensors" and result.config_written
    with safe_open(str(result.path), "np") as f:
        keys = set(f.keys())
        assert f.metadata()["format"] == "pt"
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # once, as HF saves it
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["n_layer"] == 2 and config["architectures"] == ["GPT2LMHeadModel"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # docs/checkpoints.md's line
    assert type(loaded).__name__ == "GPT2LMHeadModel" and loaded.config.n_layer == 2
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # re-tied by from_pretrained
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize(("flag", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_dtype_converts_like_torch(
    trained: tuple[nn.Module, Path], tmp_path: Path, flag: str, dtype: torch.dtype
) -> None:
    from safetensors.torch import load_file

    model, job = trained
    result = export_weights(job, tmp_path / flag, dtype=flag)
    tensors = load_file(str(result.path))
    expect = {k: v.detach().to(dtype) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert tensors.keys() == expect.keys()
    assert all(torch.equal(tensors[k], expect[k]) for k in expect)
    assert json.loads((tmp_path / flag / "config.json").read_text())["dtype"] == str(dtype).removeprefix(
        "torch."
    )


def test_conversion_matches_torch_on_edge_values() -> None:
    values = np.array(
        [0.0, -0.0, 1.0, 1.00390625, 1.01171875, 3.4e38, 7e4, 1e-8, 1e-40, -2.5, np.inf, -np.inf, np.nan],
        dtype=np.float32,
    )
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        got = torch.frombuffer(bytearray(convert(values.tobytes(), "float32", name)), dtype=dtype)
        want = torch.from_numpy(values.copy()).to(dtype)
        # bit for bit, except which NaN (torch's vectorised and scalar paths differ there too)
        assert torch.equal(got[:-1].view(torch.int16), want[:-1].view(torch.int16)), name
        assert got[-1].isnan() and want[-1].isnan()
        back = np.frombuffer(convert(got.view(torch.int16).numpy().tobytes(), name, "float32"), np.float32)
        assert back[:-1].tobytes() == want[:-1].float().numpy().tobytes() and np.isnan(back[-1]), name


def test_torch_format_keeps_the_tie_in_one_storage(trained: tuple[nn.Module, Path], tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    model, job = trained
    result = export_weights(job, tmp_path / "pt", fmt="torch")
    assert result.path.name == "pytorch_model.bin"
    sd = torch.load(result.path, weights_only=True)
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "pt")
    assert torch.equal(logits(loaded), logits(model))
    fresh, _ = gpt2(seed=9)
    fresh.load_state_dict(torch.load(tmp_path / "pt" / "pytorch_model.bin"))  # the docs' line, strict
    assert torch.equal(logits(fresh), logits(model))


class Wrapper(nn.Module):
    """A team's factory that wraps the Hugging Face model as a child, with a head of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.hf, _ = gpt2()
        self.extra = nn.Linear(2, 2)


def test_strip_prefix_exports_the_wrapped_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import GPT2LMHeadModel

    wrapper = Wrapper()
    optim = torch.optim.AdamW(wrapper.parameters(), lr=1e-2)
    save(checkpointer(tmp_path / "job"), wrapper, optim, 1)
    assert load_manifest(tmp_path / "job" / "step-00000001").meta["hf"]["prefix"] == "hf."
    code = cli_main(["checkpoint", "export-weights", str(tmp_path / "job"), str(tmp_path / "out"),
                     "--strip-prefix", "hf."])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "left out 2 tensors outside 'hf.'" in out and "extra.weight" in out
    assert "from_pretrained" in out
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "out")
    assert torch.equal(logits(loaded), logits(wrapper.hf))
    # without the flag, the recorded place of the Hugging Face model is used (and said)
    assert export_weights(tmp_path / "job", tmp_path / "auto").strip_prefix == "hf."
    # the full names, when asked: no config.json (it would not match the names)
    full = export_weights(tmp_path / "job", tmp_path / "full", strip_prefix="")
    assert not full.config_written and not (tmp_path / "full" / "config.json").exists()
    with safe_open(str(full.path), "np") as f:
        names = set(f.keys())
    assert "hf.transformer.wte.weight" in names and "extra.weight" in names


def test_a_prefix_that_matches_nothing_is_refused(trained: tuple[nn.Module, Path], tmp_path: Path) -> None:
    _, job = trained
    with pytest.raises(CheckpointError, match=r"no model tensor starts with 'hf\.'.*transformer\."):
        export_weights(job, tmp_path / "out", strip_prefix="hf.")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_both_formats_are_written_with_the_mode_of_any_new_file(
    trained: tuple[nn.Module, Path], tmp_path: Path, umask: int
) -> None:
    """0666 less the umask, as the other files of the export: a model shared through a group's
    directory is readable by whoever may read the rest of it."""
    _, job = trained
    old = os.umask(umask)
    try:
        paths = [export_weights(job, tmp_path / fmt, fmt=fmt).path for fmt in ("safetensors", "torch")]
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in paths}
    modes |= {"config.json": stat.S_IMODE((tmp_path / "safetensors" / "config.json").stat().st_mode)}
    assert modes == dict.fromkeys(["model.safetensors", "pytorch_model.bin", "config.json"], 0o666 & ~umask)
