"""Reconcile the registry with storage, for a leader that starts (and every few seconds for
live jobs): steps published in-job or renamed into place by a service that died before it
recorded them are registered, entries whose directory is gone are dropped, and staging that
can never publish is collected (all of it once the job is finished)."""

from __future__ import annotations

import logging
from pathlib import Path

from service.checkpoints.registry import Registry
from service.checkpoints.resume import sizes_match
from service.jobs.model import JobRecord
from worker.checkpoint.layout import list_published, load_manifest, parse_staging_dir
from worker.checkpoint.publish import abort_staged
from worker.errors import ElastrainError

log = logging.getLogger("elastrain.coordinator")


class StorageAdoption:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def adopt(self, record: JobRecord) -> None:
        """Make the registry say what storage holds for ``record``'s job. Idempotent."""
        if not record.checkpoint_dir:
            return  # the stand-in of a record that could not be read: no directory is known
        job_dir = Path(record.checkpoint_dir)
        on_disk = dict(list_published(job_dir))
        recorded = {e.step for e in self._registry.entries(record.id)}
        for step in recorded - on_disk.keys():
            self._registry.drop(record.id, step)
        for step, path in sorted(on_disk.items()):
            if step in recorded:
                continue
            try:
                manifest = load_manifest(path, check_files=False)  # bounded; sizes judged below
            except (OSError, ElastrainError) as exc:
                log.warning("job %s: %s has no valid manifest: %s", record.id, path, exc)
                continue
            self._registry.record(record, manifest, path, verified=sizes_match(path, manifest))
            log.info("job %s: adopted published step %s found in storage", record.id, step)
        if not job_dir.is_dir():
            return
        newest = max(on_disk, default=-1)
        for child in job_dir.iterdir():
            staged = parse_staging_dir(child.name)
            if staged is not None and (record.state.terminal or staged[0] <= newest):
                abort_staged(child, f"collected by the service: step {staged[0]} can no longer be published")
