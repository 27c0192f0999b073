"""The user's contract, checked on one micro-batch before the process group starts.

A model, a dataset or a loss that does not fit the worker fails the same way on every attempt,
so it is found here, once, as bad input (one line, exit code 2), not at the first step as a
traceback that torchrun restarts ``max_restarts`` times. The line says what the data or the
forward returned and what the worker needs. The check runs the forward as training will (train
mode, under the run's autocast) but leaves no trace: no gradient, every generator and buffer as
it was (see :func:`worker.train.objective.untouched`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from worker.datapath.datasets import Dataset
from worker.errors import SpecError
from worker.train.amp import autocast
from worker.train.objective import NEEDS, Objective, batch_size_of, call_model, describe, to_device, untouched

_BATCH = "field 'data.factory': batch(indices) must return (inputs, targets)"


def check_batch(data: Dataset, count: int) -> tuple[Any, Any]:
    """Load the first ``count`` samples and check their form; returns (inputs, targets)."""
    if len(data) <= 0:
        raise SpecError("field 'data': the dataset is empty; give it at least one sample")
    try:
        got = data.batch(np.arange(count))
    except (TypeError, ValueError, IndexError, KeyError, RuntimeError) as exc:
        raise SpecError(
            f"field 'data.factory': batch() failed on indices 0..{count - 1}: {_line(exc)}"
        ) from None
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise SpecError(f"{_BATCH}; it returned {describe(got)}")
    inputs, targets = got
    for name, value in (("inputs", inputs), ("targets", targets)):
        size = batch_size_of(value)
        if size != count:
            shape = "tensors" if size is None else f"a first dimension of {size}"
            raise SpecError(
                f"{_BATCH}, each a tensor (or a mapping of tensors) with one row per index; for "
                f"{count} indices its {name} are {describe(value)} ({shape})"
            )
    return inputs, targets


def check_contract(
    model: nn.Module,
    data: Dataset,
    *,
    objective: Objective,
    micro_batch: int,
    precision: str,
    device: torch.device,
) -> None:
    """One micro-batch through the data, the forward and the loss. Raises SpecError saying what
    came back and what the worker needs."""
    count = min(micro_batch, len(data)) if len(data) > 0 else 0
    inputs, targets = check_batch(data, count)
    with untouched(model, device):
        x, y = to_device(inputs, device), to_device(targets, device)
        try:
            with autocast(precision, device):
                output = call_model(model, x)
        except (TypeError, ValueError, IndexError, KeyError, RuntimeError, AttributeError) as exc:
            raise SpecError(
                f"field 'model.factory': the forward failed on a micro-batch of the data "
                f"(inputs: {describe(inputs)}): {_line(exc)}"
            ) from None
        try:
            total = objective.loss_sum(output, y)
        except SpecError:
            raise
        except (TypeError, ValueError, IndexError, KeyError, RuntimeError, AttributeError) as exc:
            raise SpecError(_loss_failed(objective, output, targets, exc)) from None
    if not isinstance(total, torch.Tensor) or total.dim() != 0:
        raise SpecError(f"field 'loss.factory': {objective.source} did not give per-sample losses")


def _loss_failed(objective: Objective, output: Any, targets: Any, exc: BaseException) -> str:
    field = "loss.factory" if objective.loss is not None else "model.output"
    need = ""
    if objective.loss is None and objective.output != "loss":
        need = f"; it needs {NEEDS[str(objective.task)]}"
    return (
        f"field '{field}': {objective.source} failed on the forward's output ({describe(output)}) "
        f"and the targets ({describe(targets)}){need}: {_line(exc)}"
    )


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]
