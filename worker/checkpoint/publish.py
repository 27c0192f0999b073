"""Phase 2's I/O: publish a staged step or abort it (torch-free; any coordinator calls these).

Order of durable steps (each preceded by the failpoint of the same name):
manifest.json written and fsynced, staging directory fsynced -> rename to ``step-<8 digits>`` ->
parent directory fsynced -> ``latest`` moved atomically. A crash anywhere leaves either the
staging directory (collected later, never read) or a complete step directory.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from worker.checkpoint.layout import (
    fsync_dir,
    load_manifest,
    parse_step_dir,
    read_latest,
    remove_tree,
    step_dir_name,
    write_durable,
    write_latest,
)
from worker.checkpoint.manifest import MANIFEST_NAME, Manifest, check_readable, manifest_to_json
from worker.errors import CheckpointError, CorruptCheckpointError
from worker.failpoints import failpoint

log = logging.getLogger("elastrain.checkpoint")


def publish_staged(job_dir: Path, staging: Path, manifest: Manifest) -> Path:
    """Publish ``staging`` as ``step-<manifest.step>`` and move ``latest`` to it (if newer).

    Idempotent: if the step directory already holds a valid manifest of the same step (a retry,
    or the same step saved again after a restart), the new staging directory is discarded and
    the existing step is kept. Returns the step directory.
    """
    target = job_dir / step_dir_name(manifest.step)
    if _already_published(target, manifest.step):
        if staging.exists():
            remove_tree(staging)
        _move_latest(job_dir, manifest.step)
        return target
    if not staging.is_dir():
        raise CheckpointError(f"cannot publish step {manifest.step}: staging directory {staging} is gone")
    text = manifest_to_json(manifest)
    check_readable(text, manifest.total_bytes)  # never publish what a reader would refuse
    failpoint("before_manifest_write")
    write_durable(staging / MANIFEST_NAME, text.encode())
    fsync_dir(staging)
    failpoint("before_publish_rename")
    if target.exists():  # a step directory without a valid manifest: move it out of the way
        remove_tree(target)
    os.rename(staging, target)
    failpoint("after_publish_rename")
    fsync_dir(job_dir)
    _move_latest(job_dir, manifest.step)
    return target


def _already_published(target: Path, step: int) -> bool:
    try:
        existing = load_manifest(target, check_files=False)
    except CorruptCheckpointError:
        return False
    return existing.step == step


def _move_latest(job_dir: Path, step: int) -> None:
    current = read_latest(job_dir)
    current_step = parse_step_dir(current) if current else None
    if current_step is not None and current_step > step:
        return  # never move latest backwards
    if current_step == step:
        return
    failpoint("before_latest_update")
    write_latest(job_dir, step)
    failpoint("after_latest_update")


def abort_staged(staging: Path, reason: str) -> None:
    """Remove an unpublished staging directory (idempotent) and log why."""
    log.warning("checkpoint save aborted: %s (removing %s)", reason, staging.name)
    remove_tree(staging)
