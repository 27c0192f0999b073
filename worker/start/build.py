"""Everything a run decides before its process group starts: bad input fails here (SpecError).

:func:`build` seeds, builds the data, the model and the objective, plans the batch and checks the
user's contract on one micro-batch (:mod:`worker.start.contract`), and decides where batches are loaded
(ahead on a background thread, or between micro-steps: :func:`worker.datapath.feed.choose_depth`).
Nothing here needs the group, so ``python -m worker`` can exit 2 with one line before any rank
waits for another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.datapath.datasets import Dataset, build_data, has_eval
from worker.datapath.feed import choose_depth
from worker.jobspec.spec import JobSpec
from worker.start.contract import check_contract
from worker.start.dist import DistInfo
from worker.start.models import build_model
from worker.start.parts import seed_all, set_determinism
from worker.train.objective import Objective, build_objective
from worker.train.schedule import BatchPlan, plan_batch


@dataclass(frozen=True, slots=True)
class Built:
    """What :class:`worker.train.trainer.Trainer` is constructed from (with its collaborators)."""

    spec: JobSpec
    flags: dict[str, Any]
    data: Dataset
    eval_data: Dataset | None
    model: nn.Module
    objective: Objective
    plan: BatchPlan
    prefetch: int = 0
    """Micro-batches loaded ahead of the step (see :func:`worker.datapath.feed.choose_depth`)."""
    notes: tuple[str, ...] = ()
    """Choices made here that the run record states."""


def build(spec: JobSpec, info: DistInfo, *, resuming: bool) -> Built:
    """Build one rank's run. Raises SpecError naming the field and the fix."""
    device = torch.device(info.device)
    flags = set_determinism(spec.deterministic)
    seed_all(spec.seed)  # identical model initialisation on every rank
    data = build_data(spec.data, spec.seed, "train")
    eval_data = build_data(spec.data, spec.seed, "eval") if has_eval(spec.data) else None
    model = build_model(spec.model, getattr(data, "meta", {})).to(device)
    objective = build_objective(spec, data)
    plan = plan_batch(spec, info.world_size, reference_batch=None, resuming=resuming)
    check_contract(
        model,
        data,
        objective=objective,
        micro_batch=plan.micro_batch,
        precision=spec.precision,
        device=device,
    )
    prefetch, notes = choose_depth(spec.data.prefetch, data, count=plan.micro_batch, device=device)
    return Built(
        spec=spec, flags=flags, data=data, eval_data=eval_data, model=model, objective=objective,
        plan=plan, prefetch=prefetch, notes=notes,
    )  # fmt: skip
