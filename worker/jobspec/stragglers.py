"""The JobSpec's ``stragglers`` field: when a rank counts as slow, and what is done about it.
Torch-free, like :mod:`worker.jobspec.spec`, which embeds it.

Every ``window_steps`` steps the ranks compare their compute time per step (forward, backward,
optimizer; not the time they wait for each other) on the step's own all-reduce; a rank slower
than ``slowdown`` times the median of the others in ``windows`` consecutive windows is named
(:mod:`worker.train.stragglers`). The defaults come from clean runs of the benchmark job on a
shared machine (``benchmarks/stragglers.py``): no rank was named in any of them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from worker.jobspec.limits import MAX_STEPS, Frozen

DEFAULT_SLOWDOWN = 1.3
DEFAULT_WINDOW_STEPS = 50
DEFAULT_WINDOWS = 2


class StragglerSpec(Frozen):
    slowdown: float = Field(
        default=DEFAULT_SLOWDOWN,
        gt=1,
        le=100,
        description=(
            "A rank whose compute time per step is above this multiple of the median of the other "
            "ranks' is slow in that window."
        ),
    )
    window_steps: int = Field(
        default=DEFAULT_WINDOW_STEPS,
        gt=0,
        le=MAX_STEPS,
        description="Steps per comparison window: the ranks compare their times once per window.",
    )
    windows: int = Field(
        default=DEFAULT_WINDOWS,
        gt=0,
        le=10_000,
        description="Consecutive slow windows after which a rank is named (event `straggler`).",
    )
    action: Literal["report", "replace"] = Field(
        default="report",
        description=(
            "`report`: the slow rank is named (event, metric, `elastrain report`). `replace` (peer "
            "recovery only): its node also leaves at a step boundary and a warm spare (or a new node) "
            "takes its place, without a restart or a checkpoint read."
        ),
    )
