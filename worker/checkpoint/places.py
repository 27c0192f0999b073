"""The layout operations for either kind of place a checkpoint lives (torch-free).

A job's checkpoints are under a local directory (:class:`~pathlib.Path`: ``layout.py``,
``publish.py``, fsync and rename) or an S3 prefix (:class:`S3Location`: ``remote.py``, a
create-only manifest as the commit point). Callers that serve both hold a :data:`Place` and go
through these functions, which pick the implementation; the local path keeps its own code.
"""

from __future__ import annotations

from pathlib import Path

from worker.checkpoint import layout, publish, remote
from worker.checkpoint.manifest import Manifest
from worker.checkpoint.shardio import ShardReader
from worker.jobspec.location import S3Location, parse_location

Place = Path | S3Location


def place_of(text: str | Path, *, field: str = "checkpoint.dir") -> Place:
    """A local path or an S3 location (``s3://``); another scheme raises ValueError naming
    ``field``."""
    if isinstance(text, Path):
        return text
    loc = parse_location(text, field=field)
    return loc if loc is not None else Path(text)


def staging_of(job_dir: Place, step: int, generation: int) -> Place:
    """Where phase 1 writes: a staging directory, or on S3 the step's own prefix."""
    if isinstance(job_dir, S3Location):
        return job_dir / layout.step_dir_name(step)
    return job_dir / layout.staging_dir_name(step, generation)


def staged_sizes(staging: Place) -> dict[str, int]:
    if isinstance(staging, S3Location):
        return remote.object_sizes(staging)
    return layout.file_sizes(staging)


def publish_staged(job_dir: Place, staging: Place, manifest: Manifest) -> Place:
    if isinstance(job_dir, S3Location):
        return remote.publish(job_dir, manifest)
    assert isinstance(staging, Path)
    return publish.publish_staged(job_dir, staging, manifest)


def abort_staged(staging: Place, reason: str) -> None:
    if isinstance(staging, S3Location):
        remote.abort(staging, reason)
    else:
        publish.abort_staged(staging, reason)


def list_published(job_dir: Place) -> list[tuple[int, Place]]:
    if isinstance(job_dir, S3Location):
        return list(remote.list_published(job_dir))
    return list(layout.list_published(job_dir))


def load_manifest(step_dir: Place, *, check_files: bool = True) -> Manifest:
    if isinstance(step_dir, S3Location):
        return remote.load_manifest(step_dir, check_files=check_files)
    return layout.load_manifest(step_dir, check_files=check_files)


def resolve_checkpoint(path: str | Place) -> Place:
    """A published step from a step or job path or URL (``latest``, else the newest)."""
    place = place_of(path, field="checkpoint path") if isinstance(path, str) else path
    if isinstance(place, S3Location):
        return remote.resolve_checkpoint(place)
    return layout.resolve_checkpoint(place)


def reader(step_dir: Place, manifest: Manifest) -> ShardReader:
    if isinstance(step_dir, S3Location):
        return remote.ObjectShardReader(step_dir, manifest)
    return ShardReader(step_dir, manifest)


def same_place(a: Place, b: Place) -> bool:
    if isinstance(a, S3Location) or isinstance(b, S3Location):
        return a == b
    return a.resolve() == b.resolve()
