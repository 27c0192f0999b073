"""The registry of published checkpoints: one etcd key per published step of a job (its
:class:`~service.checkpoints.results.RegistryEntry`), written by whoever publishes or adopts
the step, and the job record's ``last_published_step`` moved with it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pydantic import ValidationError

from service.checkpoints.results import CheckpointEntry, RegistryEntry
from service.etcd.kv import Write
from service.jobs import keys
from service.jobs.model import JobRecord
from service.jobs.service import JobService
from worker.checkpoint.manifest import Manifest
from worker.checkpoint.places import Place

log = logging.getLogger("elastrain.coordinator")


class Registry:
    def __init__(self, jobs: JobService, *, clock: Callable[[], float] = time.time) -> None:
        self._jobs = jobs
        self._clock = clock

    def entries(self, job_id: str) -> list[RegistryEntry]:
        """Every registered step of the job, oldest first."""
        out = []
        for entry in self._jobs.store.list_prefix(keys.checkpoints(job_id)):
            try:
                out.append(RegistryEntry.model_validate_json(entry.value))
            except ValidationError:  # a hand edit: the entry is skipped (adoption re-registers it)
                log.warning("job %s: registry entry %s cannot be read; skipped", job_id, entry.key)
        return out

    def published(self, record: JobRecord) -> list[CheckpointEntry]:
        """The registry as the API lists it, oldest first."""
        return [entry.public() for entry in self.entries(record.id)]

    def record(self, record: JobRecord, manifest: Manifest, path: Place, *, verified: bool) -> None:
        """Register a published step (idempotent) and move the job's newest published step."""
        entry = RegistryEntry(
            step=manifest.step,
            generation=manifest.generation,
            world_size=manifest.world_size,
            bytes=manifest.total_bytes,
            files=len(manifest.files),
            published_at=self._clock(),
            verified=verified,
            dir=str(path),
            metrics=manifest.metrics,
        )
        self._jobs.writes.put(keys.checkpoint(record.id, manifest.step), entry.model_dump_json().encode())

        def newest(r: JobRecord) -> JobRecord:
            if r.last_published_step is not None and r.last_published_step >= manifest.step:
                return r
            moved = r.model_copy(update={"last_published_step": manifest.step})
            return moved.with_event(
                self._clock(), "checkpoint", f"published step {manifest.step} ({path.name})"
            )

        self._jobs.update(record.id, newest)

    def aborted(self, record: JobRecord, step: int, reason: str) -> None:
        """Say in the job's events that ``step`` was aborted, and why (one line per step)."""
        message = f"step {step} aborted in {record.checkpoint_dir}: {reason}"[:1000]
        self._jobs.update(record.id, lambda r: r.with_event(self._clock(), "checkpoint_aborted", message))

    def drop(self, job_id: str, step: int) -> None:
        """Forget a step (its directory is gone). Idempotent."""
        self._jobs.writes.commit([Write(keys.checkpoint(job_id, step), None, None)])
