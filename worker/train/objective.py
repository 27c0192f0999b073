"""What the worker minimises: which part of the model's output it uses, and per-sample losses.

Every sample weighs the same (each micro-step's loss is the sum of per-sample losses times W/N,
see :mod:`worker.train.step`), so whatever computes the loss gives one loss per sample:

- the task's built-in loss (``regression``, ``classification``, ``lm``) on the selected output;
- a user loss (``loss.factory``), called as ``fn(output, targets, **kwargs)``;
- the model itself (``model.output: "loss"``): the forward's ``loss`` holds per-sample losses.

A loss tensor with more dimensions (per-token losses) counts, for each sample, as the mean over
its other dimensions, as the built-in ``lm`` loss does. A scalar is a mean over the micro-batch:
averaging such means over ranks and micro-steps would weigh samples unequally (a mean of means),
so it is refused. Losses are computed outside autocast, from fp32 (a selected floating tensor is
cast to fp32 before the loss).

:func:`check_contract` runs all of this once, on one micro-batch, before the process group starts.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from worker.datapath.datasets import TASKS, Dataset, loss_sum
from worker.errors import SpecError
from worker.jobspec.spec import JobSpec
from worker.start.models import check_kwargs
from worker.start.usercode import load_factory

Inputs = torch.Tensor | Mapping[str, torch.Tensor]

NEEDS = {
    "regression": "a tensor of predictions shaped like the targets (batch, outputs)",
    "classification": "a tensor of logits (batch, classes) for class-id targets (batch,)",
    "lm": "a tensor of logits (batch, sequence, vocabulary) for token-id targets (batch, sequence)",
}


def to_device(x: Any, device: torch.device) -> Any:
    """A tensor, or each tensor of a mapping, on ``device`` (non-blocking)."""
    if isinstance(x, Mapping):
        return {k: to_device(v, device) for k, v in x.items()}
    return x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x


def batch_size_of(value: Any) -> int | None:
    """The first dimension of a tensor, or the common one of a mapping's tensors (None if none)."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    if isinstance(value, Mapping) and value:
        sizes = {batch_size_of(v) for v in value.values()}
        return sizes.pop() if len(sizes) == 1 else None
    return None


def call_model(model: nn.Module, x: Any) -> Any:
    """``model(**x)`` for a mapping of inputs (as Hugging Face models take them), else ``model(x)``."""
    return model(**x) if isinstance(x, Mapping) else model(x)


def describe(value: Any, *, depth: int = 0) -> str:
    """A short account of a value for a message: type, keys or shape and dtype."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({str(value.dtype).removeprefix('torch.')})"
    name = type(value).__name__
    if isinstance(value, Mapping):
        keys = [str(k) for k in list(value.keys())[:12]]
        return f"{name} with keys {keys}"
    if isinstance(value, (tuple, list)):
        if depth:
            return f"a {name} of {len(value)}"
        inner = ", ".join(describe(v, depth=1) for v in value[:6])
        return f"a {name} of {len(value)}: [{inner}]"
    fields = [f for f in ("logits", "loss") if hasattr(value, f)]
    return f"{name}" + (f" with {', '.join(fields)}" if fields else "")


class Objective:
    """The output selection and the loss of a run (see the module docstring)."""

    def __init__(
        self,
        *,
        output: str | int = "auto",
        task: str | None = None,
        loss: Callable[..., Any] | None = None,
        loss_name: str = "",
        loss_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if loss is None and output != "loss" and task not in TASKS:
            raise ValueError("a run without a loss factory needs a task in " + ", ".join(TASKS))
        self.output = output
        self.task = task
        self.loss = loss
        self.loss_name = loss_name
        self.loss_kwargs = dict(loss_kwargs or {})

    @property
    def source(self) -> str:
        """Where the loss comes from, for messages and the run record."""
        if self.output == "loss":
            return "the model's own loss (model.output 'loss')"
        if self.loss is not None:
            return f"the loss factory {self.loss_name}"
        return f"the built-in {self.task!r} loss"

    def select(self, output: Any) -> Any:
        """The part of the forward's output the loss takes. Raises SpecError naming model.output."""
        if isinstance(output, torch.Tensor) and self.output in ("auto", "logits", 0):
            return output
        choice = self.output
        if choice == "auto":
            if self.loss is not None:
                return output
            if isinstance(output, Mapping):
                choice = "logits"
            elif hasattr(output, "logits"):
                return _checked(output.logits, output, "logits")
            elif isinstance(output, (tuple, list)) and output:
                return output[0]
            else:
                raise SpecError(self._cannot(output, "it has no 'logits' and is not a tuple"))
        if isinstance(choice, int):
            if isinstance(output, (tuple, list)) and -len(output) <= choice < len(output):
                return output[choice]
            raise SpecError(self._cannot(output, f"it has no element {choice}"))
        if isinstance(output, Mapping):
            if choice in output and output[choice] is not None:
                return output[choice]
        elif getattr(output, choice, None) is not None:
            return getattr(output, choice)
        hint = ""
        if choice == "loss":
            hint = (
                " (a model computes its loss only when it gets the targets: return them in the "
                "inputs mapping, e.g. as 'labels')"
            )
        raise SpecError(self._cannot(output, f"it has no {choice!r}{hint}"))

    def _cannot(self, output: Any, why: str) -> str:
        need = ""
        if self.loss is None and self.output != "loss":
            need = f"; {self.source} needs {NEEDS[str(self.task)]}"
        return (
            f"field 'model.output': {self.output!r} cannot pick from what the forward returned, "
            f"{describe(output)}: {why}{need}; set model.output to one of its keys, attributes or "
            "indices"
        )

    def sample_losses(self, output: Any, targets: Any) -> torch.Tensor:
        """One fp32 loss per sample of the micro-batch (shape ``(batch,)``)."""
        selected = self.select(output)
        if isinstance(selected, torch.Tensor) and selected.is_floating_point():
            selected = selected.float()
        rows = batch_size_of(targets)
        if self.output == "loss":
            return per_sample(selected, field="model.output", what="the forward's 'loss' is", rows=rows)
        if self.loss is not None:
            raw = self.loss(selected, targets, **self.loss_kwargs)
            return per_sample(raw, field="loss.factory", what=f"{self.loss_name} returned", rows=rows)
        raise AssertionError("the built-in losses sum in loss_sum")  # pragma: no cover

    def loss_sum(self, output: Any, targets: Any) -> torch.Tensor:
        """The sum over the micro-batch of each sample's loss, in fp32 (what worker.train.step weighs)."""
        if self.loss is None and self.output != "loss":
            selected = self.select(output)
            if not isinstance(selected, torch.Tensor):
                raise SpecError(
                    f"field 'model.output': the {self.task!r} loss needs {NEEDS[str(self.task)]}, "
                    f"and model.output {self.output!r} picked {describe(selected)}"
                )
            return loss_sum(str(self.task), selected, targets)
        return self.sample_losses(output, targets).sum()


def _checked(value: Any, output: Any, name: str) -> Any:
    if value is None:
        raise SpecError(
            f"field 'model.output': the forward returned {describe(output)} whose {name!r} is None; "
            "set model.output to the part that holds the predictions"
        )
    return value


def per_sample(value: Any, *, field: str, what: str, rows: int | None) -> torch.Tensor:
    """``value`` as one fp32 loss per sample: a (batch,) tensor, or (batch, ...) averaged over the
    other dimensions. A scalar (a mean over the micro-batch) is refused, with why and the fix, and
    so is a first dimension other than the micro-batch's ``rows`` (when known). ``what`` is the
    subject of the message with its verb ("m:f returned")."""
    if not isinstance(value, torch.Tensor):
        raise SpecError(
            f"field '{field}': {what} {describe(value)}; the worker needs a tensor of "
            "per-sample losses (shape (batch,) or (batch, ...))"
        )
    if value.dim() == 0:
        raise SpecError(
            f"field '{field}': {what} a scalar, a mean over the micro-batch; the worker "
            "needs one loss per sample (shape (batch,) or (batch, ...)), because it weighs every "
            "sample the same across ranks and micro-steps (sum of per-sample losses x W/N, never a "
            'mean of means): return them unreduced, e.g. with reduction="none"'
        )
    if rows is not None and value.shape[0] != rows:
        raise SpecError(
            f"field '{field}': {what} {describe(value)} for a micro-batch of {rows} "
            "samples; its first dimension must be the micro-batch, one loss per sample (e.g. "
            "per-token losses reshaped to (batch, tokens))"
        )
    value = value.float()
    return value if value.dim() == 1 else value.reshape(value.shape[0], -1).mean(dim=1)


def build_objective(spec: JobSpec, data: Dataset) -> Objective:
    """The run's objective from the spec; raises SpecError on a loss factory that cannot be used."""
    loss: Callable[..., Any] | None = None
    if spec.loss is not None:
        loss = load_factory(spec.loss.factory, "loss.factory")
        check_kwargs(loss, dict(spec.loss.kwargs), "loss.kwargs", skip=2)
    task = getattr(data, "task", None)
    try:
        return Objective(
            output=spec.model.output,
            task=task,
            loss=loss,
            loss_name=spec.loss.factory if spec.loss is not None else "",
            loss_kwargs=spec.loss.kwargs if spec.loss is not None else None,
        )
    except ValueError:
        raise SpecError(
            f"field 'data.factory': the dataset's task is {task!r}; without a 'loss' factory (or "
            f"model.output 'loss') it must be one of {', '.join(TASKS)} (the built-in losses)"
        ) from None


@contextlib.contextmanager
def untouched(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Run something on the model without leaving a trace: every generator (python, numpy, torch
    CPU and the device's) and every buffer (norm running statistics) is as it was afterwards."""
    py, npy = random.getstate(), np.random.get_state()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type), torch.no_grad():
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        with torch.no_grad():
            for live, saved in buffers:
                live.copy_(saved)
