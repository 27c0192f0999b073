"""A team's own code, as the worker finds it on its path (``tests.integration.worker.user_models``).

A Hugging Face ``GPT2LMHeadModel`` built from a config (no download): tied embeddings
(``lm_head.weight`` is ``transformer.wte.weight``), dropout in training, and a forward that
returns a ``CausalLMOutputWithCrossAttentions``; a ``GPTNeoXForCausalLM`` the same way (untied,
rotary positions). Plus the losses and datasets a team writes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.nn import functional

from worker.datapath.datasets import tokens


def gpt2(
    meta: dict[str, Any], *, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, dropout: float = 0.1
) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=int(meta["vocab_size"]), n_positions=int(meta["seq_len"]), n_embd=n_embd, n_layer=n_layer,
        n_head=n_head, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, tie_word_embeddings=True,
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # its own loss (with labels); else transformers warns at every call
    return model


def gpt_neox(meta: dict[str, Any], *, layers: int = 2, hidden: int = 32, heads: int = 2) -> Any:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=int(meta["vocab_size"]), max_position_embeddings=int(meta["seq_len"]), hidden_size=hidden,
        num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPTNeoXForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


def token_ce(logits: torch.Tensor, targets: torch.Tensor, *, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy, unreduced: (batch, sequence); the worker averages each sample's tokens."""
    flat = functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        reduction="none",
        label_smoothing=label_smoothing,
    )
    return flat.view(targets.shape)


def mean_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The usual mistake: a mean over the micro-batch (the worker refuses it)."""
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Labelled:
    """Token data whose inputs are a mapping with the labels, as Hugging Face models take them
    (``model(input_ids=..., labels=...)``); ``task`` is not one of the built-ins."""

    task = "causal-lm"

    def __init__(self, samples: int | None, seed: int, split: str, **kwargs: Any) -> None:
        self.inner = tokens(samples, seed, split, **kwargs)
        self.meta = self.inner.meta

    def __len__(self) -> int:
        return len(self.inner)

    def batch(self, indices: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        x, y = self.inner.batch(indices)
        return {"input_ids": x, "labels": x}, y


def labelled(samples: int | None, seed: int, split: str = "train", **kwargs: Any) -> Labelled:
    return Labelled(samples, seed, split, **kwargs)


def file_tokens(samples: int | None, seed: int, split: str = "train", *, path: str, seq_len: int = 16) -> Any:
    """A dataset that covers a file of token ids: its length is the file's, whatever ``samples`` says."""
    ids = np.fromfile(path, dtype=np.uint16).astype(np.int64)
    rows = (len(ids) - 1) // seq_len
    x = torch.from_numpy(ids[: rows * seq_len].reshape(rows, seq_len))
    y = torch.from_numpy(ids[1 : rows * seq_len + 1].reshape(rows, seq_len))
    from worker.datapath.datasets import TensorData

    return TensorData(x, y, "lm", {"vocab_size": int(ids.max()) + 1, "seq_len": seq_len, "task": "lm"})
