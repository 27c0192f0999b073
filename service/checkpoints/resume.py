"""Resume planning: the newest published checkpoint whose manifest is present and whose files
have the sizes it lists, and, for a world size, what each rank reads
(``worker.checkpoint.loadplan``). Reads storage; writes nothing."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

from service.checkpoints.registry import Registry
from service.checkpoints.results import RankLoadPlan, ResumeAnswer, ResumeCheckpoint
from service.jobs.errors import InvalidRequestError
from service.jobs.model import JobRecord
from worker.checkpoint.loadplan import bytes_read, needs_for_rank, plan_reads
from worker.checkpoint.manifest import Manifest
from worker.checkpoint.places import Place, list_published, load_manifest, place_of, staged_sizes
from worker.checkpoint.storage import StorageError
from worker.errors import ElastrainError

log = logging.getLogger("elastrain.coordinator")
PLAN_ALL_RANKS_UP_TO = 1024
"""``/resume`` without ``rank`` plans every rank only up to this world size."""


def sizes_match(step_dir: Place, manifest: Manifest) -> bool:
    """Every file the manifest lists is there with its size (on S3: every object)."""
    if not isinstance(step_dir, Path):
        sizes = staged_sizes(step_dir)
        return all(sizes.get(name) == f.size for name, f in manifest.files.items())
    return all(
        (step_dir / name).is_file() and (step_dir / name).stat().st_size == f.size
        for name, f in manifest.files.items()
    )


def rank_plan(manifest: Manifest, rank: int, world_size: int, *, full: bool) -> RankLoadPlan:
    """What ``rank`` of ``world_size`` reads of ``manifest``; ``full`` lists every read (``ops``)."""
    ops = plan_reads(manifest, needs_for_rank(manifest, rank=rank, world_size=world_size))
    files = sorted({op.file for op in ops})
    if full:
        return RankLoadPlan(
            reads=len(ops), bytes=bytes_read(ops), files=files, ops=[asdict(op) for op in ops]
        )
    return RankLoadPlan(reads=len(ops), bytes=bytes_read(ops), files=files)


class ResumePlanner:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def newest(self, record: JobRecord) -> tuple[Place, Manifest] | None:
        """The newest published, verified checkpoint whose manifest is valid and whose files are
        all there: its directory and manifest (from storage when the registry is empty)."""
        if not record.checkpoint_dir:
            return None  # the stand-in of a record that could not be read: no directory is known
        entries = [(e.step, place_of(e.dir), e.verified) for e in self._registry.entries(record.id)]
        if not entries:
            entries = [(step, path, True) for step, path in list_published(record.checkpoint_place)]
        for step, step_dir, verified in sorted(entries, key=lambda e: -e[0]):
            try:
                manifest = load_manifest(step_dir)  # bounded, and every shard on disk at its size
            except StorageError:
                raise  # the store did not answer: no reason to set the step aside (503)
            except (OSError, ElastrainError) as exc:
                log.warning("job %s: checkpoint step %s is not usable: %s", record.id, step, exc)
                continue
            if verified:
                return step_dir, manifest
        return None

    def resume(self, record: JobRecord, *, world_size: int | None, rank: int | None) -> ResumeAnswer:
        """What a starting worker group should load, and (for ``world_size``) its load plan."""
        found = self.newest(record)
        if found is None:
            return ResumeAnswer(job=record.id, checkpoint=None, load_plan=None)
        step_dir, manifest = found
        checkpoint = ResumeCheckpoint(
            step=manifest.step,
            dir=str(step_dir),
            world_size=manifest.world_size,
            generation=manifest.generation,
            bytes=manifest.total_bytes,
            reshard=world_size is not None and world_size != manifest.world_size,
        )
        if world_size is None:
            return ResumeAnswer(job=record.id, checkpoint=checkpoint, load_plan=None)
        if rank is None and world_size > PLAN_ALL_RANKS_UP_TO:
            raise InvalidRequestError(
                f"a load plan for all {world_size} ranks is too large to send; ask per rank with "
                f"rank= (or give world_size <= {PLAN_ALL_RANKS_UP_TO})"
            )
        ranks = [rank] if rank is not None else list(range(world_size))
        if any(r >= world_size for r in ranks):
            raise InvalidRequestError(f"rank {rank} is not below world_size {world_size}")
        plan = {str(r): rank_plan(manifest, r, world_size, full=rank is not None) for r in ranks}
        return ResumeAnswer(job=record.id, checkpoint=checkpoint, load_plan=plan)
