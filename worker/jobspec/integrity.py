"""The JobSpec's ``integrity`` field: how often data-parallel replicas compare their state.
Torch-free, like :mod:`worker.jobspec.spec`, which embeds it.

Under DDP every rank holds the same parameters and optimizer state, bit for bit. A value that
changed in one replica (a bad chip, a memory error) would be trained on and saved, and a
checkpoint's digests only prove that the corrupt bytes were written faithfully. So every
``every_steps`` steps, and before every checkpoint is saved, the replicas compare a digest of
their state (:mod:`worker.train.integrity`).
"""

from __future__ import annotations

from pydantic import Field

from worker.jobspec.limits import MAX_STEPS, Frozen

DEFAULT_EVERY_STEPS = 10
"""Each check hashes a quarter of the state; at this interval the benchmark MLP (the smallest
compute per byte of state the benchmarks train) spends under 1% of its step time on it."""


class IntegritySpec(Frozen):
    enabled: bool = Field(
        default=True,
        description=(
            "Compare a digest of the data-parallel replicas' parameters and optimizer state (DDP; "
            "an FSDP job has no replicas and skips it)."
        ),
    )
    every_steps: int = Field(
        default=DEFAULT_EVERY_STEPS,
        gt=0,
        le=MAX_STEPS,
        description=(
            "Steps between two comparisons; each covers a quarter of the state (all of it every "
            "four), and a comparison of all of it precedes every checkpoint save."
        ),
    )
