"""Sharded, two-phase, verified checkpoints.

Torch-free pure modules (the control plane may import them): :mod:`.manifest` (a package),
:mod:`.saveplan`, :mod:`.loadplan`, :mod:`.commit`, :mod:`.retention`, :mod:`.interval`,
:mod:`.blocks`; torch-free I/O: :mod:`.layout` (``load_manifest``, read with limits),
:mod:`.owner` (which job a directory belongs to), :mod:`.shardio`, :mod:`.publish`,
:mod:`.verify`, :mod:`.coordinator`, :mod:`.offline` (reshard), :mod:`.export` (weights-only
exports; numpy and safetensors). The torch side (:mod:`.checkpointer`, :mod:`.restore`,
:mod:`.engine`, :mod:`.state`, :mod:`.asyncsave`, :mod:`.rng`) is loaded lazily so that
importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.checkpoint.checkpointer import Checkpointer, CheckpointStats
    from worker.checkpoint.coordinator import (
        Coordinator,
        InJobCoordinator,
        MemoryStore,
        Outcome,
    )
    from worker.checkpoint.restore import Restored
    from worker.checkpoint.verify import logical_digest, verify_checkpoint

__all__ = [
    "CheckpointStats",
    "Checkpointer",
    "Coordinator",
    "InJobCoordinator",
    "MemoryStore",
    "Outcome",
    "Restored",
    "logical_digest",
    "verify_checkpoint",
]

_LAZY = {
    "CheckpointStats": "worker.checkpoint.checkpointer",
    "Checkpointer": "worker.checkpoint.checkpointer",
    "Restored": "worker.checkpoint.restore",
    "Coordinator": "worker.checkpoint.coordinator",
    "InJobCoordinator": "worker.checkpoint.coordinator",
    "MemoryStore": "worker.checkpoint.coordinator",
    "Outcome": "worker.checkpoint.coordinator",
    "logical_digest": "worker.checkpoint.verify",
    "verify_checkpoint": "worker.checkpoint.verify",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'worker.checkpoint' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
