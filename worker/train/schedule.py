"""Global batch and learning rate as pure functions of the spec, the world size and samples seen.

When the world size changes, the global batch is kept by recomputing the accumulation steps A
where ``global_batch_size`` divides by ``W * b``; otherwise the spec's ``lr_scaling`` rule
(linear, sqrt or none) rescales the LR by the ratio of the actual to the reference global batch.
The LR schedule is keyed by samples seen (successful optimizer steps only), never by local steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from worker.errors import SpecError
from worker.jobspec.spec import JobSpec, LRScheduleSpec


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How a step is composed at this world size, and why."""

    world_size: int
    micro_batch: int
    accum_steps: int
    global_batch: int
    reference_batch: int
    lr_factor: float
    note: str

    def to_json(self) -> dict[str, object]:
        return {
            "world_size": self.world_size,
            "micro_batch": self.micro_batch,
            "accum_steps": self.accum_steps,
            "global_batch": self.global_batch,
            "reference_batch": self.reference_batch,
            "lr_factor": self.lr_factor,
            "note": self.note,
        }


def _scale(rule: str, ratio: float) -> float:
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    return 1.0


def plan_batch(spec: JobSpec, world_size: int, *, reference_batch: int | None, resuming: bool) -> BatchPlan:
    """The accumulation steps and LR factor at ``world_size``.

    ``reference_batch`` is the global batch the LR was tuned for: the spec's
    ``global_batch_size`` or ``lr_reference_batch_size`` when given, else the global batch of the
    run's first start (the checkpoint remembers it; pass None on a fresh start).
    A fresh start with ``global_batch_size`` must divide exactly; a resume at a new world size
    adapts instead of failing, because the job is already running.
    """
    b = spec.micro_batch_size
    per_step = world_size * b
    ref_default = spec.lr_reference_batch_size or reference_batch
    if spec.global_batch_size is None:
        accum = spec.accum_steps_or_default
        actual = accum * per_step
        ref = ref_default or actual
        factor = _scale(spec.lr_scaling, actual / ref)
        note = f"A={accum} fixed by grad_accum_steps; global batch {actual}"
        if actual != ref:
            note += f" vs reference {ref}: lr x{factor:.4g} ({spec.lr_scaling})"
        return BatchPlan(world_size, b, accum, actual, ref, factor, note)
    target = spec.global_batch_size
    ref = spec.lr_reference_batch_size or target
    if target % per_step == 0:
        accum = target // per_step
        factor = _scale(spec.lr_scaling, target / ref)
        note = f"A={accum} keeps global batch {target} at world size {world_size}"
        return BatchPlan(world_size, b, accum, target, ref, factor, note)
    if not resuming:
        raise SpecError(
            f"field 'global_batch_size': {target} cannot be split over world size {world_size} with "
            f"micro_batch_size {b}; use a multiple of {per_step}, or change micro_batch_size"
        )
    accum = max(1, target // per_step)
    actual = accum * per_step
    factor = _scale(spec.lr_scaling, actual / ref)
    note = (
        f"global batch {target} does not divide by {per_step} at world size {world_size}: "
        f"A={accum} gives {actual}, lr x{factor:.4g} ({spec.lr_scaling})"
    )
    return BatchPlan(world_size, b, accum, actual, ref, factor, note)


def lr_at(samples_seen: int, *, base_lr: float, factor: float, schedule: LRScheduleSpec, total: int) -> float:
    """The LR after ``samples_seen`` samples of successful steps; ``total`` bounds the decay."""
    peak = base_lr * factor
    if schedule.warmup_samples and samples_seen < schedule.warmup_samples:
        return peak * (samples_seen + 1) / (schedule.warmup_samples + 1)
    if schedule.decay == "constant":
        return peak
    span = max(1, (schedule.decay_samples or total) - schedule.warmup_samples)
    progress = min(1.0, max(0.0, (samples_seen - schedule.warmup_samples) / span))
    floor = peak * schedule.min_lr_ratio
    if schedule.decay == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
