"""The checkpoint duties of one service instance, built together on its job service."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from service.checkpoints.adopt import StorageAdoption
from service.checkpoints.publish import Publisher
from service.checkpoints.registry import Registry
from service.checkpoints.resume import ResumePlanner
from service.jobs.service import JobService
from service.metrics import Metrics


@dataclass(frozen=True, slots=True)
class Checkpoints:
    """What the API's routes (publish, list, resume) and the reconciler (adopt) are given."""

    registry: Registry
    publisher: Publisher
    resumes: ResumePlanner
    storage: StorageAdoption

    @classmethod
    def build(
        cls, jobs: JobService, *, metrics: Metrics, clock: Callable[[], float] = time.time
    ) -> Checkpoints:
        registry = Registry(jobs, clock=clock)
        return cls(
            registry=registry,
            publisher=Publisher(jobs.writes, registry, metrics=metrics, clock=clock),
            resumes=ResumePlanner(registry),
            storage=StorageAdoption(registry),
        )
