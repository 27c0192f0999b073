"""Built-in data (generated deterministically from the seed, or a token file on disk) and user factories.

A data factory is called as ``factory(samples=N, seed=S, split="train"|"eval", **kwargs)`` and
returns a :class:`Dataset`: ``len()``, ``batch(indices) -> (inputs, targets)``, ``task`` and
``meta`` (the sizes the model factory needs). With ``data.samples`` unset, ``samples`` is None
and the dataset's own length is the run's (a file-backed set covers its file). ``inputs`` may be a
mapping of tensors (passed to the model as keyword arguments). ``task`` selects the built-in
loss; with a ``loss`` factory it may be anything. Losses are sums over samples in fp32, so the
trainer can divide by the true global sample count.

``batch()`` runs on a background thread, ahead of the step (see :mod:`worker.datapath.feed`), one call at a
time and in the sampler's order; a dataset that draws from the global random generators in it is
loaded on the training thread instead. The built-in ``token-file`` reads a flat binary file of
token ids through a memory map (:mod:`worker.datapath.tokenfile`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from torch.nn import functional

from worker.datapath.sizing import check_builtin_fits, is_out_of_memory, out_of_memory
from worker.errors import SpecError
from worker.jobspec.spec import DataSpec
from worker.start.models import check_kwargs
from worker.start.usercode import load_factory

TASKS = ("regression", "classification", "lm")


class Dataset(Protocol):
    task: str
    meta: dict[str, Any]

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class TensorData:
    """Inputs and targets held in memory; ``batch`` gathers rows by index."""

    inputs: torch.Tensor
    targets: torch.Tensor
    task: str
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.from_numpy(np.array(indices, dtype=np.int64))
        return self.inputs.index_select(0, index), self.targets.index_select(0, index)


def _rng(seed: int, split: str, salt: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, salt, 0 if split == "train" else 1]))


DEFAULT_SAMPLES = 4096
"""What the built-in generated sets hold when ``data.samples`` is unset."""


def synthetic(
    samples: int | None,
    seed: int,
    split: str = "train",
    *,
    task: str = "regression",
    input_dim: int = 16,
    output_dim: int = 4,
    num_classes: int = 8,
    noise: float = 0.05,
) -> TensorData:
    """Regression (``y = tanh(x A) B + noise``) or classification (``argmax(x A)``) data."""
    if task not in ("regression", "classification"):
        raise ValueError("task must be regression or classification")
    samples = DEFAULT_SAMPLES if samples is None else samples
    teacher = _rng(seed, "train", 1)  # one teacher for both splits
    a = teacher.standard_normal((input_dim, 32)).astype(np.float32) / np.sqrt(input_dim)
    rng = _rng(seed, split, 2)
    x = rng.standard_normal((samples, input_dim)).astype(np.float32)
    if task == "classification":
        logits = np.tanh(x @ a) @ teacher.standard_normal((32, num_classes)).astype(np.float32)
        y = torch.from_numpy(logits.argmax(axis=1).astype(np.int64))
        meta = {"input_dim": input_dim, "output_dim": num_classes, "task": task}
        return TensorData(torch.from_numpy(x), y, task, meta)
    b = teacher.standard_normal((32, output_dim)).astype(np.float32) / np.sqrt(32)
    target = np.tanh(x @ a) @ b + noise * rng.standard_normal((samples, output_dim)).astype(np.float32)
    meta = {"input_dim": input_dim, "output_dim": output_dim, "task": task}
    return TensorData(torch.from_numpy(x), torch.from_numpy(target.astype(np.float32)), task, meta)


def tokens(
    samples: int | None,
    seed: int,
    split: str = "train",
    *,
    vocab_size: int = 32,
    seq_len: int = 16,
    branching: int = 3,
) -> TensorData:
    """Sequences from a fixed random Markov chain: each token has ``branching`` likely successors."""
    samples = DEFAULT_SAMPLES if samples is None else samples
    teacher = _rng(seed, "train", 3)
    successors = np.stack(
        [teacher.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)]
    )
    rng = _rng(seed, split, 4)
    seq = np.empty((samples, seq_len + 1), dtype=np.int64)
    seq[:, 0] = rng.integers(0, vocab_size, size=samples)
    picks = rng.integers(0, branching, size=(samples, seq_len))
    for t in range(seq_len):
        seq[:, t + 1] = successors[seq[:, t], picks[:, t]]
    data = torch.from_numpy(seq)
    meta = {"vocab_size": vocab_size, "seq_len": seq_len, "task": "lm"}
    return TensorData(data[:, :-1].contiguous(), data[:, 1:].contiguous(), "lm", meta)


BUILTIN: dict[str, Callable[..., Any]] = {"synthetic": synthetic, "tokens": tokens}


def has_eval(spec: DataSpec) -> bool:
    """Whether the run has held-out data to evaluate on."""
    return spec.eval_samples > 0 or spec.eval_path is not None


def build_data(spec: DataSpec, seed: int, split: str = "train") -> Dataset:
    """Build one split. Raises SpecError on bad options."""
    if spec.name == "token-file":
        from worker.datapath.tokenfile import token_file

        return token_file(spec, split)
    samples = spec.samples if split == "train" else spec.eval_samples
    factory = BUILTIN[spec.name] if spec.name else load_factory(spec.factory or "", "data.factory")
    check_kwargs(factory, dict(spec.kwargs), "data.kwargs", skip=3)
    sized = "data.samples" if split == "train" else "data.eval_samples"
    if spec.name:  # built in memory by every process of the node: refuse what cannot fit first
        count = DEFAULT_SAMPLES if samples is None else samples
        check_builtin_fits(spec.name, count, dict(spec.kwargs), field=sized)
    try:
        data = factory(samples=samples, seed=seed, split=split, **spec.kwargs)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"field 'data.kwargs': {exc}") from None
    except (MemoryError, RuntimeError) as exc:
        if not is_out_of_memory(exc):
            raise
        raise out_of_memory(sized, f"the {split} data ({samples or 'default'} samples)") from None
    if not callable(getattr(data, "batch", None)) or not hasattr(data, "__len__"):
        raise SpecError(
            "field 'data.factory': must return a dataset with len() and batch(indices), "
            f"not {type(data).__name__}"
        )
    if split == "train" and samples is not None and len(data) != samples:
        raise SpecError(
            f"field 'data.samples': the factory returned {len(data)} samples, not {samples}; "
            "leave data.samples unset to train on the dataset's own length"
        )
    return data


def loss_sum(task: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The sum over samples of each sample's loss, computed in fp32 whatever autocast produced."""
    out = output.float()
    if task == "regression":
        return ((out - target.float()) ** 2).mean(dim=1).sum()
    if task == "classification":
        return functional.cross_entropy(out, target, reduction="sum")
    per_token = functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1), reduction="none")
    return per_token.view(target.shape).mean(dim=1).sum()
