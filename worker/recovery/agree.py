"""What each member holds, as a fixed-size int64 summary all-gathered (no pickle), and the digests
that make "the same state" checkable: parameters, persistent buffers and optimizer state
(xxh3-128, in name order), and the caller's progress blob (canonical JSON)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch import nn

from worker.checkpoint.state import tied_names
from worker.recovery.plan import SUMMARY_LEN, Summary, decode_summary, encode_summary


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def _feed(hasher: Any, name: str, tensor: torch.Tensor) -> None:
    hasher.update(f"{name}|{tensor.dtype!s}|{tuple(tensor.shape)}|".encode())
    hasher.update(_tensor_bytes(tensor))


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> bytes:
    """xxh3-128 over the model's state dict (parameters and persistent buffers; a tied tensor
    once) and the optimizer's per-parameter state and hyper-parameters, all in name order. Reads
    only: an optimizer that has not stepped keeps its empty state."""
    hasher = xxhash.xxh3_128()
    state = model.state_dict()
    aliases = tied_names(state)
    for name in sorted(state):
        value = state[name]
        if name not in aliases and isinstance(value, torch.Tensor):
            _feed(hasher, "model." + name, value)
    names = {id(p): n for n, p in model.named_parameters()}
    per_param = sorted(
        ((names.get(id(p), f"?{i}"), st) for i, (p, st) in enumerate(optimizer.state.items())),
        key=lambda item: item[0],
    )
    for pname, st in per_param:
        for key in sorted(st):
            value = st[key]
            if isinstance(value, torch.Tensor):
                _feed(hasher, f"optim.{pname}.{key}", value)
            else:
                hasher.update(f"optim.{pname}.{key}={json.dumps(value, default=str)}".encode())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    hasher.update(json.dumps(groups, sort_keys=True, default=str).encode())
    return hasher.digest()


def progress_digest(progress: dict[str, Any]) -> bytes:
    """xxh3-128 of the progress blob as canonical JSON."""
    return xxhash.xxh3_128(json.dumps(progress, sort_keys=True, separators=(",", ":")).encode()).digest()


def spec_digest(spec_hash: str) -> bytes:
    return xxhash.xxh3_128(spec_hash.encode()).digest()


def gather_summaries(mine: Summary, *, device: str = "cpu") -> list[Summary]:
    """Every member's summary, by rank (one all_gather of ``SUMMARY_LEN`` int64 each)."""
    world = dist.get_world_size()
    local = torch.tensor(encode_summary(mine), dtype=torch.int64, device=device)
    out = [torch.zeros(SUMMARY_LEN, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(out, local)
    return [decode_summary(rank, [int(v) for v in t.tolist()]) for rank, t in enumerate(out)]


def agree_digests(ok: bool, digest: bytes, *, layout: bytes, device: str = "cpu") -> tuple[bool, bool]:
    """One all_gather of ``(ok, digest, layout)``: whether every member is ``ok`` and holds
    ``digest``, and whether every member reports the same real DDP bucket ``layout`` (a digest;
    zeros: none); the same two answers on every member."""
    words = [int(ok)] + [
        int.from_bytes(b[i : i + 8], "little", signed=True) for b in (digest, layout) for i in (0, 8)
    ]
    local = torch.tensor(words, dtype=torch.int64, device=device)
    out = [torch.zeros(len(words), dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return read_agreement([tuple(int(v) for v in t.tolist()) for t in out])


def read_agreement(rows: list[tuple[int, ...]]) -> tuple[bool, bool]:
    """:func:`agree_digests`'s two answers from the gathered rows ``(ok, digest x2, layout x2)``.
    Pure."""
    agreed = all(r[0] == 1 for r in rows) and len({r[:3] for r in rows}) == 1
    layouts = {r[3:] for r in rows}
    return agreed, agreed and len(layouts) == 1 and layouts != {(0, 0)}
