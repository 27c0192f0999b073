"""The per-rank mechanics of a save (phase 1 + waiting for phase 2) and of a load.

``prepare_save`` turns live state into a :class:`SaveJob` (what to write, already planned);
``persist`` writes it into staging, reports, and waits for the outcome; ``load_into`` reads the
rows this rank holds from a published step, verifying every block it uses.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from worker.checkpoint.commit import Report
from worker.checkpoint.coordinator import Coordinator, Outcome
from worker.checkpoint.layout import fsync_dir, shard_file_name, staging_dir_name, step_dir_name
from worker.checkpoint.loadplan import Need, plan_reads
from worker.checkpoint.manifest import Manifest, TensorEntry
from worker.checkpoint.places import Place, reader
from worker.checkpoint.remote import is_published, upload_shard
from worker.checkpoint.saveplan import Assignment, plan_rank
from worker.checkpoint.shardio import write_shard
from worker.checkpoint.state import LiveState, byte_view, rows_of
from worker.checkpoint.verify import meta_digest
from worker.errors import CheckpointError
from worker.failpoints import failpoint

log = logging.getLogger("elastrain.checkpoint")


@dataclass(slots=True)
class SaveJob:
    """Everything one rank needs to stage and report a step; holds no module references."""

    step: int
    generation: int
    seq: int
    rank: int
    world_size: int
    job_dir: Place
    block_size: int
    items: list[tuple[Assignment, torch.Tensor]]
    headers: dict[str, TensorEntry]
    meta_digest: str
    rank_meta: dict[str, Any]
    context: dict[str, Any] = field(default_factory=dict)

    @property
    def staging(self) -> Place:
        if isinstance(self.job_dir, Path):
            return self.job_dir / staging_dir_name(self.step, self.generation)
        return self.job_dir / step_dir_name(self.step)  # on S3 shards go under the step itself


def json_copy(value: Any, what: str) -> Any:
    """A deep copy through JSON (what the manifest will hold); refuses what JSON cannot carry."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON-able: {exc}") from None


def plan_items(live: LiveState, *, rank: int, world_size: int) -> list[tuple[Assignment, torch.Tensor]]:
    """The (assignment, tensor rows) this rank writes; rows are views of the live tensors."""
    infos = [lt.info for lt in live.tensors.values()]
    out = []
    for a in plan_rank(infos, rank=rank, world_size=world_size):
        lt = live.tensors[a.name]
        base = lt.info.local_rows[0] if lt.info.kind == "sharded" and lt.info.local_rows else 0
        out.append((a, rows_of(lt.local, a.start - base, a.stop - base)))
    return out


def headers_of(live: LiveState) -> dict[str, TensorEntry]:
    return {
        n: TensorEntry(lt.info.dtype, lt.info.shape, lt.info.kind, owner=lt.info.owner)  # type: ignore[arg-type]
        for n, lt in live.tensors.items()
    }


def new_job(
    live: LiveState, *, step: int, generation: int, seq: int, rank: int, world_size: int, job_dir: Place,
    block_size: int, meta: dict[str, Any], rank_meta: dict[str, Any], context: dict[str, Any],
) -> SaveJob:  # fmt: skip
    return SaveJob(
        step=step,
        generation=generation,
        seq=seq,
        rank=rank,
        world_size=world_size,
        job_dir=job_dir,
        block_size=block_size,
        items=plan_items(live, rank=rank, world_size=world_size),
        headers=headers_of(live),
        meta_digest=meta_digest(meta),
        rank_meta=rank_meta,
        context=context,
    )


def host_items(items: list[tuple[Assignment, torch.Tensor]]) -> list[tuple[Assignment, torch.Tensor]]:
    """Contiguous CPU tensors (copies only where the live tensor is not one already)."""
    return [
        (a, t if t.device.type == "cpu" and t.is_contiguous() else t.detach().cpu().contiguous())
        for a, t in items
    ]


def stage(job: SaveJob) -> Report:
    """Phase 1 on this rank: write the shard file into staging, fsync, build the report.
    An OSError (ENOSPC, EIO...) becomes a failure report instead of an exception."""
    try:
        items = [(a, byte_view(t)) for a, t in host_items(job.items)]
        if isinstance(job.staging, Path):
            os.makedirs(job.staging, exist_ok=True)
            pieces, fentry = write_shard(
                job.staging / shard_file_name(job.rank),
                items,
                block_size=job.block_size,
                after_first_piece=lambda: failpoint("during_shard_write"),
            )
            fsync_dir(job.staging)
        else:
            if is_published(job.staging):  # never overwrite a committed step's shards
                raise CheckpointError(f"{job.staging} is already published")
            pieces, fentry = upload_shard(
                job.staging / shard_file_name(job.rank),
                items,
                block_size=job.block_size,
                after_first_piece=lambda: failpoint("during_shard_write"),
            )
        failpoint("after_shard_write")
        failpoint("before_report")
    except (OSError, CheckpointError) as exc:
        return failure_report(job, exc)
    return Report(
        job.step,
        job.generation,
        job.rank,
        job.world_size,
        ok=True,
        files={shard_file_name(job.rank): fentry},
        pieces=tuple(pieces),
        tensors=job.headers,
        meta_digest=job.meta_digest,
        rank_meta=job.rank_meta,
        context=job.context if job.rank == 0 else {},
    )


def failure_report(job: SaveJob, exc: Exception) -> Report:
    """A rank's report of a save it could not stage: the error, with the directory it was
    writing when the error does not name a file (a full volume must be findable)."""
    log.warning("rank %d could not stage step %d: %s", job.rank, job.step, exc)
    where = "" if getattr(exc, "filename", None) else f" (writing {job.staging})"
    error = f"{type(exc).__name__}: {exc}{where}"
    return Report(job.step, job.generation, job.rank, job.world_size, ok=False, error=error)


def persist(
    job: SaveJob, coordinator: Coordinator, *, timeout: float, error: Exception | None = None
) -> tuple[Outcome, int, float]:
    """Stage (or, given ``error``, report that this rank failed), report, wait for the outcome.
    Returns (outcome, bytes written, seconds)."""
    t0 = time.perf_counter()
    report = stage(job) if error is None else failure_report(job, error)
    coordinator.report(report, seq=job.seq)
    outcome = coordinator.outcome(job.step, job.generation, seq=job.seq, timeout=timeout)
    return outcome, report.bytes, time.perf_counter() - t0


# ---------------------------------------------------------------- load


def needs_of(live: LiveState) -> list[Need]:
    out = []
    for name, lt in sorted(live.tensors.items()):
        if lt.info.kind == "sharded" and lt.info.local_rows is not None:
            out.append(Need(name, *lt.info.local_rows))
        else:
            out.append(Need(name, 0, lt.info.rows))
    return out


def check_compatible(manifest: Manifest, live: LiveState) -> None:
    """Raise :class:`CheckpointError` if the checkpoint does not describe this model/optimizer."""
    stored = {n for n, t in manifest.tensors.items() if t.kind != "per_rank"}
    # A checkpoint from before alias tables stored a tied tensor under each name: the live
    # model's tied names are filled through the stored one, their copies are not needed.
    missing, extra = (
        sorted(set(live.tensors) - stored),
        sorted(stored - set(live.tensors) - set(live.aliases)),
    )
    if missing or extra:
        raise CheckpointError(
            f"checkpoint step {manifest.step} does not match the model/optimizer: missing {missing[:5]}, "
            f"unexpected {extra[:5]} (a different model, or a weights-only export?)"
        )
    for name, lt in live.tensors.items():
        entry = manifest.tensors[name]
        if (entry.dtype, entry.shape) != (lt.info.dtype, lt.info.shape):
            raise CheckpointError(
                f"{name}: checkpoint has {entry.dtype}{list(entry.shape)}, "
                f"the model {lt.info.dtype}{list(lt.info.shape)}"
            )


def load_into(step_dir: Place, manifest: Manifest, live: LiveState) -> int:
    """Fill this rank's live tensors from ``step_dir``; returns bytes read. Raises
    :class:`CorruptCheckpointError` (file and offset) on a missing, short or bad block."""
    needs = needs_of(live)
    buffers: dict[tuple[str, int], memoryview] = {}
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for need in needs:
        local = live.tensors[need.name].local
        if local.numel() == 0:
            continue
        host = (
            local
            if local.device.type == "cpu" and local.is_contiguous()
            else torch.empty_like(local, device="cpu")
        )
        if host is not local:
            staged.append((local, host))
        buffers[(need.name, need.start)] = byte_view(host)
    with reader(step_dir, manifest) as shards:
        shards.run(plan_reads(manifest, needs), buffers)
        for local, host in staged:
            local.copy_(host)
        return shards.bytes_read
