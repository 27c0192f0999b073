"""Resume: pick a published step every rank can verify, load it in place, restore RNG.

``resume: auto`` tries published steps newest first. Each rank reads and verifies the bytes it
needs; the ranks then agree through the store (a checkpoint is used only if it verified on every
rank). A corrupt one is refused with its reason logged and counted, and the next older one is
tried. A checkpoint that does not fit the model (missing tensors, other shapes, another data
version) is an error, not a fallback. ``resume: <path>`` (a step or job directory) loads exactly
that, or fails -- until the job has published steps of its own since it (see ``_candidates``).
After a load, rank 0 sets every newer step of the job aside (``.corrupt-*`` if it was refused,
``.superseded-*`` otherwise) so that no later resume or publish can mix two histories, and
points ``latest`` at the step loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.checkpoint import remote
from worker.checkpoint.coordinator import KeyValueStore, store_allgather
from worker.checkpoint.engine import check_compatible, load_into
from worker.checkpoint.layout import fsync_dir, read_latest, step_dir_name, write_latest
from worker.checkpoint.manifest import MANIFEST_NAME, Manifest
from worker.checkpoint.places import Place, list_published, load_manifest, resolve_checkpoint, same_place
from worker.checkpoint.rng import derive_rng, restore_rng
from worker.checkpoint.state import LiveState, apply, capture
from worker.errors import CheckpointError, CorruptCheckpointError

#: ``event(name, **fields)``: a structured event (the Checkpointer logs and forwards it).
EventFn = Callable[..., None]


@dataclass(frozen=True, slots=True)
class RestoreContext:
    """What a restore needs to know about this rank and its job (the Checkpointer's view)."""

    job_dir: Place
    resume: str  # "auto" or a step/job directory (``checkpoint.resume``)
    job: str
    session: str
    rank: int
    world_size: int
    generation: int
    seed: int
    data_version: str
    timeout_s: float
    store: KeyValueStore


@dataclass(frozen=True, slots=True)
class Restored:
    step: int
    progress: dict[str, Any]
    path: Place
    manifest_path: Place
    rng_restored: bool
    notes: list[str] = field(default_factory=list)
    bytes_read: int = 0
    origin: str = ""  # what the steps saved after this load record as their origin
    saved_world_size: int = 0  # the world size that wrote it


def _candidates(ctx: RestoreContext) -> tuple[list[Place], bool]:
    """Step directories to try, newest first, and whether falling back is allowed.

    ``resume: <path>`` names where a job *starts*: once the job has published steps of its own
    since it started from that path, a restart resumes from those (newest first, falling back to
    older ones and finally to the path), as Composer's ``autoresume`` does over ``load_path`` and
    torchtitan's ``initial_load_path``. Otherwise every torchrun restart would reload the path and
    set the job's own progress aside. A step was published since that start when its manifest
    records the same ``checkpoint.resume`` as its origin (:func:`origin_of`); so a rollback to a
    step of the job's own directory is not undone by the steps written before it."""
    own = [p for _, p in reversed(list_published(ctx.job_dir))]
    if ctx.resume == "auto":
        return own, True
    since = [p for p in own if _origin(p) in (ctx.resume, None)]
    try:
        start = resolve_checkpoint(ctx.resume)
    except CheckpointError:
        if since:  # the starting point is gone (e.g. retention removed a rolled-back-to step)
            return since, True
        raise
    since = [p for p in since if not same_place(p, start)]
    return [*since, start], bool(since)


def _origin(step_dir: Place) -> str | None:
    """The ``checkpoint.resume`` a step's job started from, ``""`` for none, or None when its
    manifest cannot be read (kept as a candidate: the load refuses it, counted, like any corrupt
    step)."""
    try:
        return str(load_manifest(step_dir).meta.get("origin") or "")
    except (CheckpointError, OSError):
        return None


def origin_of(resume: str, manifest: Manifest) -> str:
    """The origin the steps saved after this load record: the explicit start, or under ``auto``
    what the loaded step recorded."""
    return resume if resume != "auto" else str(manifest.meta.get("origin") or "")


def _try(ctx: RestoreContext, step_dir: Place, live: LiveState) -> tuple[str, str, Manifest | None, int]:
    """(status, reason, manifest, bytes read); status is ok, corrupt or incompatible."""
    try:
        manifest = load_manifest(step_dir)
        if ctx.data_version and manifest.data_version and manifest.data_version != ctx.data_version:
            raise CheckpointError(
                f"{step_dir} was written for data version {manifest.data_version!r}, this job has "
                f"{ctx.data_version!r}; resume from a matching checkpoint or set checkpoint.resume: never"
            )
        check_compatible(manifest, live)
        nbytes = load_into(step_dir, manifest, live)
    except CorruptCheckpointError as exc:
        return "corrupt", str(exc), None, 0
    except CheckpointError as exc:
        return "incompatible", str(exc), None, 0
    except OSError as exc:
        return "corrupt", f"{step_dir}: {exc}", None, 0
    return "ok", "", manifest, nbytes


def _agree(ctx: RestoreContext, attempt: int, index: int, status: str, reason: str) -> list[dict[str, str]]:
    if ctx.world_size == 1:
        return [{"status": status, "reason": reason}]
    prefix = f"elastrain/ckpt/{ctx.job}/{ctx.session}/g{ctx.generation}/restore{attempt}/c{index}"
    got = store_allgather(
        ctx.store, prefix, rank=ctx.rank, world_size=ctx.world_size,
        value=json.dumps({"status": status, "reason": reason}), timeout=ctx.timeout_s,
    )  # fmt: skip
    return [json.loads(g) for g in got]


def restore(
    ctx: RestoreContext,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    attempt: int,
    event: EventFn,
    on_refused: Callable[[], None],
) -> Restored | None:
    """Load per ``ctx.resume`` (collective: every rank calls it with the same ``attempt``).
    ``on_refused`` is called once per checkpoint refused as corrupt (and ``event`` told why)."""
    candidates, fallback = _candidates(ctx)
    if not candidates:
        event("checkpoint_none_to_resume", dir=str(ctx.job_dir))
        return None
    live = capture(model, optimizer)
    refused: list[Place] = []
    for index, step_dir in enumerate(candidates):
        status, reason, manifest, nbytes = _try(ctx, step_dir, live)
        answers = _agree(ctx, attempt, index, status, reason)
        bad = [(r, a) for r, a in enumerate(answers) if a["status"] != "ok"]
        if not bad:
            assert manifest is not None
            break
        rank, answer = bad[0]
        why = f"rank {rank}: {answer['reason']}"
        if any(a["status"] == "incompatible" for _, a in bad):
            raise CheckpointError(f"cannot resume from {step_dir}: {why}")
        on_refused()
        event("checkpoint_refused", path=str(step_dir), reason=why, fallback=fallback)
        if not fallback:
            raise CorruptCheckpointError(f"cannot resume from {step_dir}: {why}")
        refused.append(step_dir)
    else:
        raise CheckpointError(
            f"no published checkpoint in {ctx.job_dir} verifies ({len(refused)} refused, reasons logged); "
            "repair or remove them, or set checkpoint.resume: never to start over"
        )
    notes = apply(model, optimizer, live, manifest.meta.get("extra", {}))
    rng_restored = _rng(ctx, manifest, notes)
    if ctx.rank == 0:
        _settle(ctx, manifest.step, step_dir, refused, event)
    event(
        "checkpoint_restored", step=manifest.step, path=str(step_dir), bytes=nbytes, rng_restored=rng_restored
    )
    return Restored(
        step=manifest.step,
        progress=dict(manifest.meta.get("progress", {})),
        path=step_dir,
        manifest_path=step_dir / MANIFEST_NAME,
        rng_restored=rng_restored,
        notes=notes,
        bytes_read=nbytes,
        origin=origin_of(ctx.resume, manifest),
        saved_world_size=manifest.world_size,
    )


def _rng(ctx: RestoreContext, manifest: Manifest, notes: list[str]) -> bool:
    saved = manifest.rank_meta.get(str(ctx.rank), {}).get("rng")
    if saved is not None:
        restore_rng(saved)
        return True
    seed = derive_rng(ctx.seed, manifest.step, ctx.rank)
    notes.append(
        f"rank {ctx.rank} has no saved RNG state (the checkpoint was written by {manifest.world_size} ranks"
        f"{', then resharded' if 'resharded' in manifest.run_record else ''}): its RNG was derived from "
        f"(seed {ctx.seed}, step {manifest.step}, rank {ctx.rank}) -> {seed}"
    )
    return False


def _settle(ctx: RestoreContext, step: int, step_dir: Place, refused: list[Place], event: EventFn) -> None:
    """Rank 0 after a load: set newer steps aside and point ``latest`` at the loaded step.
    Only in this job's own directory: a checkpoint loaded from elsewhere is only read."""
    job_dir = ctx.job_dir
    if not same_place(step_dir.parent, job_dir):
        return
    if isinstance(job_dir, remote.S3Location):
        _settle_remote(job_dir, step, refused, event)
        return
    assert isinstance(step_dir, Path)
    refused_names = {p.name for p in refused}
    for newer, path in list_published(job_dir):
        if newer <= step:
            continue
        assert isinstance(path, Path)
        tag = "corrupt" if path.name in refused_names else "superseded"
        aside = _unused(job_dir / f".{tag}-{path.name}-g{ctx.generation}")
        os.replace(path, aside)
        event("checkpoint_set_aside", path=str(path), to=aside.name)
    if read_latest(job_dir) != step_dir_name(step):
        write_latest(job_dir, step)
    fsync_dir(job_dir)


def _settle_remote(job: remote.S3Location, step: int, refused: list[Place], event: EventFn) -> None:
    """:func:`_settle` on S3: newer steps are unpublished (their manifest kept aside as
    ``.corrupt-step-N.json`` or ``.superseded-step-N.json``), then ``latest`` moves back."""
    refused_names = {p.name for p in refused}
    for newer, path in remote.list_published(job):
        if newer > step:
            tag = "corrupt" if path.name in refused_names else "superseded"
            event("checkpoint_set_aside", path=str(path), to=remote.set_aside(path, tag))
    remote.move_latest(job, step, backwards=True)


def _unused(path: Path) -> Path:
    """``path``, or ``path.1``, ``path.2``, ... : a step set aside twice under one generation (a
    second rollback past it) must not fail on, or replace, the first one."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}.{n}")
    return candidate
