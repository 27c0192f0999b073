"""The seam between the trainer and :mod:`worker.recovery`: its configuration, what the trainer
lends a recovery (:class:`RecoverableState`), and what a recovery tells it (:class:`Outcome`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from worker.recovery.group import GroupInfo
from worker.recovery.membership import Keys
from worker.recovery.plan import Policy
from worker.recovery.transfer import CHUNK_BYTES, MAX_CHUNK_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryConfig:
    """``secret``: the job's worker secret (authenticates the control channel); ``advertise``:
    the address other members reach this process at; ``desired_world``: the size to form when
    etcd's ``desired`` says nothing (the first generation's size)."""

    job_id: str
    secret: bytes
    spec_hash: str
    policy: Policy
    desired_world: int | None = None
    advertise: str = "127.0.0.1"
    backend: str = "gloo"
    device: str = "cpu"
    collective_timeout_s: float = 60.0
    chunk_bytes: int = CHUNK_BYTES
    max_attempts: int = 5

    def __post_init__(self) -> None:
        Keys(self.job_id)
        if len(self.secret) < 16:
            raise ValueError(
                "recovery: the job secret must be at least 16 bytes; the service gives one per job"
            )
        if self.collective_timeout_s <= 0:
            raise ValueError(
                f"recovery.collective_timeout_s must be positive, got {self.collective_timeout_s}"
            )
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"recovery: chunk_bytes must lie in 1 .. {MAX_CHUNK_BYTES}, got {self.chunk_bytes}"
            )
        if self.max_attempts < 1:
            raise ValueError(f"recovery: max_attempts must be at least 1, got {self.max_attempts}")


class RecoverableState(Protocol):
    """What the trainer lends a recovery. ``model`` is the unwrapped module. ``progress()`` is
    the replicated JSON state besides tensors (step, samples, sampler cursor, loss scaler, grad
    monitor, batch plan, version...): equal on every member at the same version, and
    ``load_progress(p)`` makes ``progress()`` return ``p``. ``version()`` counts committed windows
    (skipped fp16 windows included). ``void_window()`` drops the in-flight window's gradients
    (``zero_grad(set_to_none=True)``) and every reference to the DDP wrapper. ``layout()`` is the
    digest of the DDP wrapper it still holds, settled (:func:`worker.recovery.rewrap.layout_digest`;
    zeros: none). ``rewrap(info)`` wraps DDP on the new default group and settles it
    (:func:`worker.recovery.rewrap.rewrap`); ``rewrap(info, keep=True)`` (every member holds a
    settled DDP of the same layout) points the one it holds at the new group instead
    (:func:`worker.recovery.rewrap.carry_over`)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def version(self) -> int: ...

    def progress(self) -> dict[str, Any]: ...

    def load_progress(self, blob: dict[str, Any]) -> None: ...

    def void_window(self) -> None: ...

    def layout(self) -> bytes: ...

    def rewrap(self, info: GroupInfo, *, keep: bool = False) -> None: ...


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a join or recovery did. ``kind``: ``peer`` (state from a member's memory, or nobody
    needed any), ``storage`` (no member holds a usable state: restore from the checkpoint),
    ``fenced``, ``fallback`` (give up: exit, torchrun restarts), ``leave`` (a smaller group
    without this member). ``phases``: unix times of ``detected``, ``formed``, ``transferred``,
    ``ready`` (re-wrapped and settled)."""

    kind: str
    reason: str = ""
    info: GroupInfo | None = None
    source_rank: int | None = None
    bytes_from_peers: int = 0
    voided_windows: int = 0
    version: int = 0
    lost: tuple[str, ...] = ()
    promoted: tuple[str, ...] = ()
    world_before: int = 0
    attempts: int = 0
    phases: dict[str, float] = field(default_factory=dict)
