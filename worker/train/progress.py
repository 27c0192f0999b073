"""The JSON-able training position that a checkpoint carries besides tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.datapath.sampler import SamplerState
from worker.train.amp import DynamicLossScaler
from worker.train.monitor import GradMonitor
from worker.train.schedule import BatchPlan


@dataclass(slots=True)
class Progress:
    """Where a run stands: successful steps, samples, the sampler, the best metric."""

    step: int = 0
    samples_seen: int = 0
    samples_skipped: int = 0
    sampler: SamplerState = field(default_factory=SamplerState)
    reference_batch: int | None = None
    best_metric: float | None = None
    last_loss: float | None = None

    def to_json(self, scaler: DynamicLossScaler, monitor: GradMonitor, plan: BatchPlan) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "samples_skipped": self.samples_skipped,
            "epoch": self.sampler.epoch,
            "sampler": self.sampler.to_json(),
            "micro_step": 0,  # checkpoints are taken only at optimizer-step boundaries
            "reference_batch": self.reference_batch,
            "best_metric": self.best_metric,
            "last_loss": self.last_loss,
            "loss_scaler": scaler.state_dict(),
            "monitor": monitor.state_dict(),
            "batch_plan": plan.to_json(),
            "lr_schedule": {"keyed_by": "samples_seen", "samples_seen": self.samples_seen},
        }

    @staticmethod
    def from_json(raw: dict[str, Any]) -> Progress:
        return Progress(
            step=int(raw["step"]),
            samples_seen=int(raw["samples_seen"]),
            samples_skipped=int(raw.get("samples_skipped", 0)),
            sampler=SamplerState.from_json(raw["sampler"]),
            reference_batch=raw.get("reference_batch"),
            best_metric=raw.get("best_metric"),
            last_loss=raw.get("last_loss"),
        )
