"""Resume: pick a published step every rank can verify, load it in place, restore RNG.

``resume: auto`` tries published steps newest first. Each rank reads and verifies the bytes it
needs; the ranks then agree through the store (a checkpoint is used only if it verified on every
rank). A corrupt one is refused with its reason logged and counted, and the next older one is
tried. A checkpoint that does not fit the model (missing tensors, other shapes, another data
version) is an error, not a fallback. ``resume: <path>`` (a step or job directory) loads exactly
that, or fails. After a load, rank 0 sets every newer step of the job aside (``.corrupt-*`` if it
was refused, ``.superseded-*`` otherwise) so that no later resume or publish can mix two
histories, and points ``latest`` at the step loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from worker.checkpoint.coordinator import store_allgather
from worker.checkpoint.engine import check_compatible, load_into
from worker.checkpoint.layout import (
    fsync_dir,
    list_published,
    read_latest,
    resolve_checkpoint,
    step_dir_name,
    write_latest,
)
from worker.checkpoint.manifest import MANIFEST_NAME, Manifest
from worker.checkpoint.rng import derive_rng, restore_rng
from worker.checkpoint.state import LiveState, apply, capture
from worker.checkpoint.verify import load_manifest
from worker.errors import CheckpointError, CorruptCheckpointError

if TYPE_CHECKING:
    from worker.checkpoint.api import Checkpointer, Restored


def _candidates(ck: Checkpointer) -> tuple[list[Path], bool]:
    """Step directories to try, newest first, and whether falling back is allowed."""
    assert ck.job_dir is not None
    if ck.cfg.resume == "auto":
        return [p for _, p in reversed(list_published(ck.job_dir))], True
    return [resolve_checkpoint(ck.cfg.resume)], False


def _try(ck: Checkpointer, step_dir: Path, live: LiveState) -> tuple[str, str, Manifest | None, int]:
    """(status, reason, manifest, bytes read); status is ok, corrupt or incompatible."""
    try:
        manifest = load_manifest(step_dir)
        if ck.data_version and manifest.data_version and manifest.data_version != ck.data_version:
            raise CheckpointError(
                f"{step_dir} was written for data version {manifest.data_version!r}, this job has "
                f"{ck.data_version!r}; resume from a matching checkpoint or set checkpoint.resume: never"
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


def _agree(ck: Checkpointer, attempt: int, index: int, status: str, reason: str) -> list[dict[str, str]]:
    if ck.world_size == 1:
        return [{"status": status, "reason": reason}]
    prefix = f"elastrain/ckpt/{ck.job}/{ck.session}/g{ck.generation}/restore{attempt}/c{index}"
    got = store_allgather(
        ck.store, prefix, rank=ck.rank, world_size=ck.world_size,
        value=json.dumps({"status": status, "reason": reason}), timeout=ck.timeout_s,
    )  # fmt: skip
    return [json.loads(g) for g in got]


def restore(
    ck: Checkpointer, *, model: nn.Module, optimizer: torch.optim.Optimizer, attempt: int
) -> Restored | None:
    from worker.checkpoint.api import Restored

    candidates, fallback = _candidates(ck)
    if not candidates:
        ck.event("checkpoint_none_to_resume", dir=str(ck.job_dir))
        return None
    live = capture(model, optimizer)
    refused: list[Path] = []
    for index, step_dir in enumerate(candidates):
        status, reason, manifest, nbytes = _try(ck, step_dir, live)
        answers = _agree(ck, attempt, index, status, reason)
        bad = [(r, a) for r, a in enumerate(answers) if a["status"] != "ok"]
        if not bad:
            assert manifest is not None
            break
        rank, answer = bad[0]
        why = f"rank {rank}: {answer['reason']}"
        if any(a["status"] == "incompatible" for _, a in bad):
            raise CheckpointError(f"cannot resume from {step_dir}: {why}")
        ck.stats.verification_failures_total += 1
        ck.event("checkpoint_refused", path=str(step_dir), reason=why, fallback=fallback)
        if not fallback:
            raise CorruptCheckpointError(f"cannot resume from {step_dir}: {why}")
        refused.append(step_dir)
    else:
        raise CheckpointError(
            f"no published checkpoint in {ck.job_dir} verifies ({len(refused)} refused, reasons logged); "
            "repair or remove them, or set checkpoint.resume: never to start over"
        )
    ck.stats.bytes_read_total += nbytes
    notes = apply(model, optimizer, live, manifest.meta.get("extra", {}))
    rng_restored = _rng(ck, manifest, notes)
    if ck.rank == 0:
        _settle(ck, manifest.step, step_dir, refused)
    ck.event(
        "checkpoint_restored", step=manifest.step, path=str(step_dir), bytes=nbytes, rng_restored=rng_restored
    )
    return Restored(
        step=manifest.step,
        progress=dict(manifest.meta.get("progress", {})),
        path=step_dir,
        manifest_path=step_dir / MANIFEST_NAME,
        rng_restored=rng_restored,
        notes=notes,
    )


def _rng(ck: Checkpointer, manifest: Manifest, notes: list[str]) -> bool:
    saved = manifest.rank_meta.get(str(ck.rank), {}).get("rng")
    if saved is not None:
        restore_rng(saved)
        return True
    seed = derive_rng(ck.seed, manifest.step, ck.rank)
    notes.append(
        f"rank {ck.rank} has no saved RNG state (the checkpoint was written by {manifest.world_size} ranks"
        f"{', then resharded' if 'resharded' in manifest.run_record else ''}): its RNG was derived from "
        f"(seed {ck.seed}, step {manifest.step}, rank {ck.rank}) -> {seed}"
    )
    return False


def _settle(ck: Checkpointer, step: int, step_dir: Path, refused: list[Path]) -> None:
    """Rank 0 after a load: set newer steps aside and point ``latest`` at the loaded step."""
    job_dir = ck.job_dir
    assert job_dir is not None
    if step_dir.resolve().parent != job_dir.resolve():
        return
    refused_names = {p.name for p in refused}
    for newer, path in list_published(job_dir):
        if newer <= step:
            continue
        tag = "corrupt" if path.name in refused_names else "superseded"
        aside = job_dir / f".{tag}-{path.name}-g{ck.generation}"
        os.replace(path, aside)
        ck.event("checkpoint_set_aside", path=str(path), to=aside.name)
    if read_latest(job_dir) != step_dir_name(step):
        write_latest(job_dir, step)
    fsync_dir(job_dir)
