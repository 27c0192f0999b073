"""Tied and shared parameters are stored once and re-tied on load; persistent buffers are
saved, non-persistent ones are not. A real ``transformers`` GPT-2 built from
a small config (no download) is the tied model; the world of one runs here, other world sizes
and FSDP run in tests/integration/checkpoint/test_tied_torchrun.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.checkpoint.helpers import checkpointer, save, state_equal
from worker.checkpoint.layout import load_manifest
from worker.checkpoint.manifest import manifest_from_json, manifest_to_json
from worker.checkpoint.offline import reshard
from worker.checkpoint.shardio import ShardReader
from worker.checkpoint.verify import iter_tensor_bytes, logical_digest, verify_checkpoint
from worker.errors import CheckpointError, CorruptCheckpointError

DATA = Path(__file__).with_name("data")
WTE, HEAD = "model.transformer.wte.weight", "model.lm_head.weight"


def gpt2(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    model = GPT2LMHeadModel(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model: nn.Module, optim: torch.optim.Optimizer, n: int = 1) -> None:
    gen = torch.Generator().manual_seed(n)
    for _ in range(n):
        ids = torch.randint(0, 64, (2, 12), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()


def tied(model: nn.Module) -> bool:
    return model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr,operator]


def test_a_tied_weight_is_stored_once_and_re_tied_on_load(tmp_path: Path) -> None:
    model, optim = gpt2()
    step(model, optim, 2)
    save(checkpointer(tmp_path), model, optim, 2)
    m = load_manifest(tmp_path / "step-00000002")
    assert WTE in m.tensors and HEAD not in m.tensors and m.aliases == {HEAD: WTE}
    unique = {p.data_ptr(): p for p in model.parameters()}.values()
    states = [v for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert m.total_bytes == sum(t.numel() * t.element_size() for t in [*unique, *states])
    model2, optim2 = gpt2(seed=1)
    restored = checkpointer(tmp_path).restore(model=model2, optimizer=optim2)
    assert restored is not None and tied(model2) and state_equal(model, model2, optim, optim2)
    rng = torch.get_rng_state()  # restored: dropout draws the same masks in both continuations
    step(model, optim, 2)
    torch.set_rng_state(rng)
    step(model2, optim2, 2)
    assert tied(model2) and state_equal(model, model2, optim, optim2)  # bitwise, same steps


def test_the_logical_digest_counts_a_shared_tensor_once(tmp_path: Path) -> None:
    model, optim = gpt2()
    save(checkpointer(tmp_path), model, optim, 1)
    m = load_manifest(tmp_path / "step-00000001")
    with ShardReader(tmp_path / "step-00000001", m) as reader:
        for name in m.tensors:
            for _ in iter_tensor_bytes(reader, name):
                pass
        assert reader.bytes_read == m.total_bytes  # every stored byte once: the tie is not read twice
    digest = logical_digest(tmp_path)
    out = reshard(tmp_path, tmp_path / "w3", world_size=3)  # the alias travels with the tensors
    assert load_manifest(out).aliases == {HEAD: WTE} and logical_digest(out) == digest
    untied = dataclasses.replace(m, aliases={})  # the tie is part of the logical state
    staged = tmp_path / "untied" / "step-00000001"
    shutil.copytree(tmp_path / "step-00000001", staged)
    (staged / "manifest.json").write_text(manifest_to_json(untied))
    assert logical_digest(staged) != digest


def test_a_model_tied_otherwise_than_the_checkpoint_is_refused_by_name(tmp_path: Path) -> None:
    model, optim = gpt2()
    step(model, optim, 1)
    save(checkpointer(tmp_path), model, optim, 1)
    other, _ = gpt2(seed=3)
    other.lm_head.weight = nn.Parameter(other.lm_head.weight.detach().clone())  # type: ignore[union-attr]
    other_optim = torch.optim.AdamW(other.parameters(), lr=1e-2, weight_decay=0.1)
    with pytest.raises(CheckpointError, match=r"does not match the model.*lm_head"):
        checkpointer(tmp_path).restore(model=other, optimizer=other_optim)


def test_a_checkpoint_from_before_aliases_loads_into_a_tied_model(tmp_path: Path) -> None:
    """``data/v1-tied-step`` was written by the previous release: a tiny model whose head is its
    embedding, both names stored (the duplicate this issue removes)."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    job = tmp_path / "job"
    shutil.copytree(DATA / "v1-tied-step", job / "step-00000002")
    old = load_manifest(job / "step-00000002")
    assert {"model.emb.weight", "model.head.weight"} <= set(old.tensors) and old.aliases == {}
    model = Tied()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert checkpointer(job).restore(model=model, optimizer=optim) is not None
    with ShardReader(job / "step-00000002", old) as reader:
        stored = b"".join(bytes(c) for c in iter_tensor_bytes(reader, "model.emb.weight"))
    assert model.head.weight is model.emb.weight
    assert model.emb.weight.detach().numpy().tobytes() == stored


def test_persistent_buffers_are_saved_and_non_persistent_ones_are_not(tmp_path: Path) -> None:
    class Net(nn.Module):
        def __init__(self, fill: float) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("kept", torch.full((3,), fill))
            self.register_buffer("scratch", torch.full((3,), fill), persistent=False)

    a, b = Net(1.0), Net(2.0)
    save(checkpointer(tmp_path), a, torch.optim.SGD(a.parameters(), lr=0.1), 1)
    m = load_manifest(tmp_path / "step-00000001")
    assert "model.kept" in m.tensors and "model.scratch" not in m.tensors
    checkpointer(tmp_path).restore(model=b, optimizer=torch.optim.SGD(b.parameters(), lr=0.1))
    assert b.kept.tolist() == [1.0] * 3 and b.scratch.tolist() == [2.0] * 3


def test_the_alias_table_is_validated(tmp_path: Path) -> None:
    model, optim = gpt2()
    save(checkpointer(tmp_path), model, optim, 1)
    raw = json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())
    for aliases, problem in [
        ({HEAD: "model.nowhere"}, "not a stored tensor"),
        ({WTE: WTE}, "is a stored tensor"),
        ({HEAD: 3}, "string"),
    ]:
        raw["aliases"] = aliases
        with pytest.raises(CorruptCheckpointError, match=problem):
            manifest_from_json(json.dumps(raw))
    assert verify_checkpoint(tmp_path)[1] == []
