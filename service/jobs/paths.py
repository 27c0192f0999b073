"""Where a job's checkpoints may live: inside the storage root, or on object storage.

``checkpoint_dir`` refuses NUL bytes, ``..`` components, absolute paths outside the root and
symlinks that lead out of it, with a :class:`PathError` naming the field and the fix. Only
``os.path.realpath`` touches the filesystem (to see existing symlinks); nothing is created. An
``s3://BUCKET/PREFIX`` location is taken only when the service has object storage credentials
(:class:`~service.jobs.objectstore.ObjectStorage`); whether the bucket answers is checked at
submit (:meth:`~service.jobs.objectstore.ObjectStorage.check`).
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from service.jobs.objectstore import NOT_CONFIGURED, ObjectStorage
from worker.errors import SpecError
from worker.jobspec.location import S3Location, is_url, parse_location
from worker.jobspec.paths import RESUME_KEYWORDS

Place = Path | S3Location


class PathError(SpecError):
    """A path field that would leave the storage root."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"field '{field}': {message}")
        self.field = field


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root and path != root


def contained(given: str, *, root: Path, field: str, base: Path | None = None) -> Path:
    """``given`` resolved inside ``root`` (relative paths against ``base``, default ``root``)."""
    if "\x00" in given:
        raise PathError(field, "contains a NUL byte; give a plain directory name")
    if not given.strip():
        raise PathError(field, "is empty; leave it out to use the default")
    if ".." in PurePosixPath(given).parts:
        raise PathError(field, f"{given!r} contains '..'; give a path inside the storage root without '..'")
    real_root = os.path.realpath(root)
    candidate = Path(given) if os.path.isabs(given) else (base or root) / given
    real = os.path.realpath(candidate)
    if not _inside(real, real_root):
        what = "resolves (through a symlink)" if _inside(os.path.abspath(candidate), real_root) else "is"
        raise PathError(
            field,
            f"{given!r} {what} outside the storage root {str(root)!r}; "
            "give a relative directory name (it is placed under the storage root)",
        )
    return Path(real)


def s3_location(given: str, *, field: str, storage: ObjectStorage | None) -> S3Location:
    """``given`` (an ``s3://`` URL) as a location the service can use; :class:`PathError` naming
    ``field`` and the fix when the service has no object storage or the URL is not one."""
    try:
        loc = parse_location(given, field=field)
    except ValueError as exc:
        raise PathError(field, str(exc).removeprefix(f"{field}: ")) from None
    if loc is None:
        raise PathError(field, f"{given[:200]!r} is not an s3:// location")
    if storage is None:
        raise PathError(field, f"{loc}: {NOT_CONFIGURED}")
    return loc


def check_reachable(loc: S3Location, *, field: str, storage: ObjectStorage) -> None:
    """:class:`PathError` naming ``field`` unless the service reaches ``loc`` (one listing: a
    missing bucket, refused credentials or an unreachable endpoint, with the fix)."""
    try:
        storage.check(loc, field=field)
    except SpecError as exc:
        raise PathError(field, str(exc).removeprefix(f"field '{field}': ")) from None


def checkpoint_dir(
    given: str | None, *, root: Path, job_id: str, storage: ObjectStorage | None = None
) -> Place:
    """The job's checkpoint location: ``<root>/<job id>`` by default, an ``s3://`` location
    when given one (and the service has object storage), else ``given`` contained in ``root``."""
    if given is None:
        return Path(os.path.realpath(root)) / job_id
    if is_url(given):
        return s3_location(given, field="checkpoint.dir", storage=storage)
    return contained(given, root=root, field="checkpoint.dir")


def resume_source(given: str, *, root: Path, job_dir: Place, storage: ObjectStorage | None = None) -> str:
    """``checkpoint.resume`` (which the schema has checked, :func:`worker.jobspec.paths.check_resume`):
    a keyword as is, an ``s3://`` location (when the service has object storage), else a path
    inside the storage root, relative ones against the job's own directory (``step-00000012``:
    that step of the job's own; on S3, under the job's prefix)."""
    if given in RESUME_KEYWORDS:
        return given
    if is_url(given):
        return str(s3_location(given, field="checkpoint.resume", storage=storage))
    if isinstance(job_dir, S3Location):
        return str(s3_location(f"{job_dir}/{given}", field="checkpoint.resume", storage=storage))
    return str(contained(given, root=root, field="checkpoint.resume", base=job_dir))
