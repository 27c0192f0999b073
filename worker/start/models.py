"""Built-in models (deterministic from the seed, no downloads) and user factories.

A model factory is called as ``factory(meta, **kwargs)``, where ``meta`` describes the data
(``input_dim``, ``output_dim``, ``vocab_size``, ``seq_len``, ``task``), and returns an
``nn.Module`` whose forward takes the data's inputs (a tensor, or a mapping passed as keyword
arguments) and returns what it returns: a tensor, a tuple, a mapping or an object with
``logits`` (see :mod:`worker.train.objective` for how the worker picks from it).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from worker.datapath.sizing import is_out_of_memory, out_of_memory
from worker.errors import SpecError
from worker.jobspec.spec import ModelSpec
from worker.start.usercode import load_factory


def _dropout(p: float) -> nn.Module:
    """Dropout with probability ``p``; nothing at all (no module, no RNG draw) at 0."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout must be at least 0 and below 1, got {p}")
    return nn.Dropout(p) if p > 0 else nn.Identity()


class MLP(nn.Module):
    """A small multi-layer perceptron; ``norm`` = "batch" exercises running statistics and
    ``dropout`` > 0 a model that draws from the RNG in training (off by default)."""

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        hidden: int = 64,
        depth: int = 2,
        norm: str = "none",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if norm not in ("none", "batch", "layer"):
            raise ValueError("norm must be one of none, batch, layer")
        _dropout(dropout)
        layers: list[nn.Module] = []
        width = input_dim
        for _ in range(depth):
            layers.append(nn.Linear(width, hidden))
            if norm == "batch":
                layers.append(nn.BatchNorm1d(hidden))
            elif norm == "layer":
                layers.append(nn.LayerNorm(hidden))
            layers.append(nn.ReLU())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, output_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.drop = _dropout(dropout)
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.n_heads, d // self.n_heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, d)))
        out: torch.Tensor = x + self.drop(self.mlp(self.ln2(x)))
        return out


class TinyGPT(nn.Module):
    """A small decoder-only transformer for next-token prediction; ``dropout`` (off by default)
    on the embeddings and on each residual branch."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        d_model: int = 32,
        n_layers: int = 2,
        n_heads: int = 2,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.drop = _dropout(dropout)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        nn.init.normal_(self.pos, std=1.0 / math.sqrt(d_model))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(tokens) + self.pos[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(self.ln_f(x))
        return out


def _mlp(meta: dict[str, Any], **kwargs: Any) -> nn.Module:
    return MLP(int(meta["input_dim"]), int(meta["output_dim"]), **kwargs)


def _tiny_gpt(meta: dict[str, Any], **kwargs: Any) -> nn.Module:
    return TinyGPT(int(meta["vocab_size"]), int(meta["seq_len"]), **kwargs)


BUILTIN: dict[str, Callable[..., nn.Module]] = {"mlp": _mlp, "tiny-gpt": _tiny_gpt}


def check_kwargs(target: Callable[..., Any], kwargs: dict[str, Any], field: str, skip: int) -> None:
    """Refuse keyword arguments ``target`` does not take, before anything is built."""
    try:
        params = list(inspect.signature(target).parameters.values())[skip:]
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    known = {p.name for p in params}
    for key in kwargs:
        if key not in known:
            raise SpecError(
                f"field '{field}.{key}': not an option here; known: {', '.join(sorted(known)) or 'none'}"
            )


# The built-ins take their sizes from the data; the rest of the class's arguments are options.
_BUILTIN_OPTIONS: dict[str, type[nn.Module]] = {"mlp": MLP, "tiny-gpt": TinyGPT}


def build_model(spec: ModelSpec, meta: dict[str, Any]) -> nn.Module:
    """Build the model on CPU in fp32 (the master copy). Raises SpecError on bad options."""
    factory = BUILTIN[spec.name] if spec.name else load_factory(spec.factory or "", "model.factory")
    if spec.name:
        check_kwargs(_BUILTIN_OPTIONS[spec.name], dict(spec.kwargs), "model.kwargs", skip=2)
    else:
        check_kwargs(factory, dict(spec.kwargs), "model.kwargs", skip=1)
    try:
        model = factory(meta, **spec.kwargs)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"field 'model.kwargs': {exc}") from None
    except (MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise out_of_memory("model.kwargs", "the model") from None
    if not isinstance(model, nn.Module):
        raise SpecError("field 'model.factory': the factory must return a torch.nn.Module")
    return model.float()
