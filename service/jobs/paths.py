"""Where a job's checkpoints may live: always inside the storage root.

``checkpoint_dir`` refuses NUL bytes, ``..`` components, absolute paths outside the root and
symlinks that lead out of it, with a :class:`PathError` naming the field and the fix. Only
``os.path.realpath`` touches the filesystem (to see existing symlinks); nothing is created.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from worker.errors import SpecError
from worker.jobspec.paths import RESUME_KEYWORDS


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


def _not_a_url(given: str, field: str) -> None:
    """The service keeps a job's checkpoints under its storage root: an ``s3://`` location (which
    a job run under bare torchrun may use) is refused here rather than taken for a relative path."""
    if "://" in given:
        raise PathError(
            field, f"{given!r}: the service keeps checkpoints under its storage root; give a path inside it"
        )


def checkpoint_dir(given: str | None, *, root: Path, job_id: str) -> Path:
    """The job's checkpoint directory: ``<root>/<job id>`` by default, else ``given`` contained."""
    if given is None:
        return Path(os.path.realpath(root)) / job_id
    _not_a_url(given, "checkpoint.dir")
    return contained(given, root=root, field="checkpoint.dir")


def resume_source(given: str, *, root: Path, job_dir: Path) -> str:
    """``checkpoint.resume`` (which the schema has checked, :func:`worker.jobspec.paths.check_resume`):
    a keyword as is, else a path inside the storage root, relative ones against the job's own
    directory (``step-00000012``: that step of the job's own)."""
    if given in RESUME_KEYWORDS:
        return given
    _not_a_url(given, "checkpoint.resume")
    return str(contained(given, root=root, field="checkpoint.resume", base=job_dir))
