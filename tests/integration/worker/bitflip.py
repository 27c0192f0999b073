"""A team's model with a fault in it, as the worker finds it on its path
(``tests.integration.worker.bitflip:mlp``): the built-in MLP, and a forward hook that flips one
bit of one weight on one rank, as a bad chip or a memory error would, once per run.

``flip_rank``: the rank (torchrun's ``RANK``) whose replica is hit; ``flip_call``: at its
``flip_call``-th training forward (1-based: with two micro-steps a step, call ``2s - 1`` is the
first of step ``s``); ``flip_tensor``, ``flip_index``, ``flip_bit``: which bit of which element
of which parameter. ``marker``: a file created when the bit is flipped; while it exists the hook
does nothing, so a restarted group trains the same steps again without the fault. Without
``marker`` the model is the plain MLP.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.start.models import MLP


def mlp(
    meta: dict[str, Any],
    *,
    hidden: int = 32,
    norm: str = "none",
    dropout: float = 0.0,
    flip_rank: int = 1,
    flip_call: int = 1,
    flip_tensor: str = "net.0.weight",
    flip_index: int = 0,
    flip_bit: int = 22,
    marker: str = "",
) -> nn.Module:
    model = MLP(int(meta["input_dim"]), int(meta["output_dim"]), hidden=hidden, norm=norm, dropout=dropout)
    if marker and int(os.environ.get("RANK", "0")) == flip_rank:
        param = dict(model.named_parameters())[flip_tensor]
        calls = [0]

        def flip(module: nn.Module, args: Any) -> None:
            if not module.training:
                return
            calls[0] += 1
            if calls[0] != flip_call or Path(marker).exists():
                return
            with torch.no_grad():
                word = param.view(-1)[flip_index : flip_index + 1].view(torch.int32)
                word ^= torch.tensor((1 << flip_bit) - (1 << 32 if flip_bit == 31 else 0), dtype=torch.int32)
            Path(marker).touch()

        model.register_forward_pre_hook(flip)
    return model
