"""The training state as named tensors plus JSON extras, via DCP's state-dict helpers.

``get_state_dict``/``set_state_dict`` give FQN-keyed model and (flattened) optimizer state for a
plain module, a DDP module's ``.module`` and an FSDP2 ``fully_shard`` module alike, and
initialise optimizer state before a load. Tensor names: ``model.<fqn>`` (parameters and
persistent buffers, e.g. norm running stats) and ``optim.state.<fqn>.<key>`` (moments, step).
Non-tensor entries (``optim.param_groups.<fqn>.<key>``: lr, betas, weight decay...) are JSON
extras.

Tied and shared parameters: the model state dict names a tied tensor once per module that holds
it (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``, same memory; DCP keys its
optimizer state by the first name only). The first name is the stored tensor; the others become
``aliases`` (name -> stored name) and are not stored again. On load they need nothing: the live
state dict's alias entries share memory with the stored one, which is filled in place.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from worker.checkpoint.manifest import ITEMSIZE
from worker.checkpoint.saveplan import TensorInfo
from worker.errors import CheckpointError

MODEL_PREFIX = "model."
OPTIM_PREFIX = "optim."
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(slots=True)
class LiveTensor:
    """One named tensor: ``local`` is this rank's part (the whole tensor unless sharded)."""

    info: TensorInfo
    local: torch.Tensor


@dataclass(slots=True)
class LiveState:
    tensors: dict[str, LiveTensor]
    extra: dict[str, Any]
    model_sd: dict[str, Any]
    optim_sd: dict[str, Any]
    aliases: dict[str, str] = field(default_factory=dict)  # tied name -> stored name


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise CheckpointError(f"tensors of dtype {name} cannot be checkpointed")
    return name


def _describe(name: str, value: torch.Tensor) -> LiveTensor:
    if isinstance(value, DTensor):
        placements = tuple(value.placements)
        local = value.to_local().detach()
        shape = tuple(value.shape)
        if all(isinstance(p, Replicate) for p in placements):
            return LiveTensor(TensorInfo(name, dtype_name(value.dtype), shape), local)
        if len(placements) == 1 and isinstance(placements[0], Shard) and placements[0].dim == 0:
            local_shape, offset = compute_local_shape_and_global_offset(
                value.shape, value.device_mesh, placements
            )
            lo = int(offset[0]) if shape else 0
            rows = (lo, lo + int(local_shape[0])) if shape else (0, 1)
            if tuple(local.shape) != tuple(local_shape):
                raise CheckpointError(f"{name}: local shard {tuple(local.shape)} is not {tuple(local_shape)}")
            return LiveTensor(TensorInfo(name, dtype_name(value.dtype), shape, "sharded", rows), local)
        raise CheckpointError(
            f"{name}: DTensor placements {placements} are not supported "
            "(only Shard(0) on a 1-D mesh, or Replicate)"
        )
    t = value.detach()
    return LiveTensor(TensorInfo(name, dtype_name(t.dtype), tuple(t.shape)), t)


def _json_extra(name: str, value: Any) -> Any:
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        raise CheckpointError(
            f"{name}: value of type {type(value).__name__} is neither a tensor nor JSON-able"
        ) from None


def _json_extras(extra: dict[str, Any]) -> dict[str, Any]:
    """A JSON copy of all extras at once (one per value only to name one that is not JSON-able;
    a save is on the training thread's clock, and there is one extra per parameter and key)."""
    try:
        copied: dict[str, Any] = json.loads(json.dumps(extra))
        return copied
    except (TypeError, ValueError):
        return {name: _json_extra(name, value) for name, value in extra.items()}


def capture(model: nn.Module, optimizer: torch.optim.Optimizer) -> LiveState:
    """This rank's view of the model and optimizer state (tensors share memory with the live
    state; nothing is copied). Initialises optimizer state if the optimizer has not stepped."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    tensors: dict[str, LiveTensor] = {}
    extra: dict[str, Any] = {}
    aliases = tied_names(model_sd, MODEL_PREFIX)
    for prefix, sd in ((MODEL_PREFIX, model_sd), (OPTIM_PREFIX, optim_sd)):
        for key, value in sd.items():
            name = prefix + key
            if name in aliases:
                continue
            if isinstance(value, torch.Tensor):
                tensors[name] = _describe(name, value)
            else:
                extra[name] = value
    return LiveState(
        tensors=tensors, extra=_json_extras(extra), model_sd=model_sd, optim_sd=optim_sd, aliases=aliases
    )


def tied_names(state_dict: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{name: first name}`` for every entry that is the same tensor as an earlier one (same
    memory, offset, shape, strides and dtype; for a DTensor, of its local shard). The first
    name in state-dict order is the stored one: every rank builds the same model, so every rank
    picks the same."""
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for key, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        if local.numel() == 0:
            continue  # empty tensors may share a null pointer without being one tensor
        ident = (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape),
                 local.stride(), local.dtype)  # fmt: skip
        if ident in first:
            out[prefix + key] = prefix + first[ident]
        else:
            first[ident] = key
    return out


def apply(
    model: nn.Module, optimizer: torch.optim.Optimizer, live: LiveState, extra: dict[str, Any]
) -> list[str]:
    """Load ``live`` (whose tensors were filled in place) and ``extra`` into model and optimizer.

    JSON turned tuples into lists; they are turned back where the live value is a tuple.
    Returns notes about extras missing from the checkpoint (the live value is kept).
    """
    notes = []
    for prefix, sd in ((MODEL_PREFIX, live.model_sd), (OPTIM_PREFIX, live.optim_sd)):
        for key, value in sd.items():
            if isinstance(value, torch.Tensor):
                continue
            name = prefix + key
            if name not in extra:
                notes.append(f"{name} not in checkpoint; kept {value!r}")
                continue
            loaded = extra[name]
            sd[key] = tuple(loaded) if isinstance(value, tuple) and isinstance(loaded, list) else loaded
    set_state_dict(
        model, optimizer, model_state_dict=live.model_sd, optim_state_dict=live.optim_sd, options=_OPTIONS
    )
    return notes


def _storage(t: torch.Tensor) -> int:
    if isinstance(t, DTensor):
        t = t.to_local()
    return int(t.untyped_storage().data_ptr())


def optimizer_owned(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor lives in the memory of a parameter or of optimizer state, which only the
    optimizer step writes (a forward pass can rewrite buffers, e.g. norm running statistics)."""
    ptrs = {_storage(p) for p in model.parameters()}
    for per_param in optimizer.state.values():
        ptrs.update(_storage(v) for v in per_param.values() if isinstance(v, torch.Tensor))
    ptrs.discard(0)
    return lambda t: int(t.untyped_storage().data_ptr()) in ptrs


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, sharing its memory."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(b"")
    return t.reshape(-1).view(torch.uint8).numpy().data


def rows_of(t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a tensor (a 0-d tensor is one row)."""
    return t if t.dim() == 0 else t[start:stop]
