"""Reconcile the registry with storage, for a leader that starts (and every few seconds for
live jobs): steps published in-job or renamed into place by a service that died before it
recorded them are registered, entries whose directory is gone are dropped, and staging that
can never publish is collected (all of it once the job is finished). On S3 the same holds of the
job's prefix: a step counts as published when its manifest exists, and the shards under a step
prefix without one are staging."""

from __future__ import annotations

import logging

from service.checkpoints.registry import Registry
from service.checkpoints.resume import sizes_match
from service.jobs.model import JobRecord
from worker.checkpoint.layout import parse_staging_dir, parse_step_dir
from worker.checkpoint.places import abort_staged, list_published, load_manifest
from worker.checkpoint.remote import abort as abort_unpublished
from worker.checkpoint.storage import StorageError, storage_for
from worker.errors import ElastrainError
from worker.jobspec.location import S3Location

log = logging.getLogger("elastrain.coordinator")


class StorageAdoption:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def adopt(self, record: JobRecord) -> None:
        """Make the registry say what storage holds for ``record``'s job. Idempotent."""
        if not record.checkpoint_dir:
            return  # the stand-in of a record that could not be read: no directory is known
        job_dir = record.checkpoint_place
        on_disk = dict(list_published(job_dir))
        recorded = {e.step for e in self._registry.entries(record.id)}
        for step in recorded - on_disk.keys():
            self._registry.drop(record.id, step)
        for step, path in sorted(on_disk.items()):
            if step in recorded:
                continue
            try:
                manifest = load_manifest(path, check_files=False)  # bounded; sizes judged below
            except StorageError:
                raise  # the store did not answer: the next pass tries again
            except (OSError, ElastrainError) as exc:
                log.warning("job %s: %s has no valid manifest: %s", record.id, path, exc)
                continue
            self._registry.record(record, manifest, path, verified=sizes_match(path, manifest))
            log.info("job %s: adopted published step %s found in storage", record.id, step)
        newest = max(on_disk, default=-1)
        if isinstance(job_dir, S3Location):
            _collect_remote(job_dir, set(on_disk), newest=newest, everything=record.state.terminal)
            return
        if not job_dir.is_dir():
            return
        for child in job_dir.iterdir():
            staged = parse_staging_dir(child.name)
            if staged is not None and (record.state.terminal or staged[0] <= newest):
                abort_staged(child, f"collected by the service: step {staged[0]} can no longer be published")


def _collect_remote(job: S3Location, published: set[int], *, newest: int, everything: bool) -> None:
    """Remove the shards under the job's step prefixes that have no manifest and can no longer
    publish (at most ``newest``; all of them with ``everything``)."""
    dirs, _ = storage_for(job).listing(job.prefix)
    for d in dirs:
        step = parse_step_dir(d.rsplit("/", 1)[-1])
        if step is not None and step not in published and (everything or step <= newest):
            abort_unpublished(
                job / d.rsplit("/", 1)[-1],
                f"collected by the service: step {step} can no longer be published",
            )
