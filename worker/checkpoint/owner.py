"""Which job a checkpoint directory belongs to, torch-free.

A job's checkpoint directory belongs to one job. The marker is ``<dir>/OWNER.json``, one JSON
object (UTF-8, at most 64 KiB, written once and never rewritten)::

    {"format": "elastrain-checkpoint-owner/1", "job": "<job id>",
     "claimed_unix": 1733050000.123, "host": "node-3", "pid": 4242}

``job`` is the job's identity: ``ELASTRAIN_JOB_ID`` when the service launched the worker, else
the spec's ``name`` (:func:`job_identity`). ``claimed_unix`` is when the directory was claimed
(seconds since the epoch); ``host`` and ``pid`` say who claimed it (for people; never compared).
Readers ignore other fields; a different ``format`` is refused.

* Rank 0 claims the directory when the job first uses it (:func:`claim`), before anything else
  is written there: the marker is written to a temporary file, fsynced, and hard-linked into
  place, so it appears complete or not at all and exactly one of two jobs claiming at once
  wins. The other ranks only check (:func:`check_owner`).
* A directory whose marker names another job is refused (:class:`DirectoryOwnedError`, a
  :class:`SpecError`: exit 2 when raised before the process group starts), naming
  ``checkpoint.dir`` and the fix; nothing is written, set aside or deleted there.
* Another job may start *from* such a directory only by saying so: ``checkpoint.resume:
  <path>`` loads it read-only (restore writes only in the job's own directory).
* Retention deletes nothing in a directory another job owns
  (:func:`worker.checkpoint.retention.apply_retention` with ``job``).
* A directory without a marker (written before markers existed, or by
  ``elastrain checkpoint reshard``) is claimed by the first job that uses it.

The service records the same claim in etcd; this file is what a worker can check by itself.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from worker.checkpoint.layout import fsync_dir, write_durable
from worker.errors import SpecError
from worker.jobspec.jsonlimits import JSONRefused, loads

OWNER_FILE = "OWNER.json"
FORMAT = "elastrain-checkpoint-owner/1"
_MAX_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Owner:
    job: str
    claimed_unix: float
    host: str = ""
    pid: int = 0

    def to_json(self) -> str:
        body = {"format": FORMAT, "job": self.job, "claimed_unix": self.claimed_unix, "host": self.host,
                "pid": self.pid}  # fmt: skip
        return json.dumps(body) + "\n"


class DirectoryOwnedError(SpecError):
    """The job's ``checkpoint.dir`` belongs to another job."""


def job_identity(env: Mapping[str, str], spec_name: str) -> str:
    """``ELASTRAIN_JOB_ID`` (set by the service for what it launches), else the spec's name."""
    return env.get("ELASTRAIN_JOB_ID") or spec_name


def read_owner(job_dir: Path) -> Owner | None:
    """The directory's owner, or None when it has no marker. Raises :class:`SpecError` (one
    line naming the file and the fix) for a marker that cannot be read."""
    path = job_dir / OWNER_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise _unreadable(path, exc.strerror or str(exc)) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _unreadable(path, "not a regular file")
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        raw = loads(data, max_bytes=_MAX_BYTES, max_depth=2, what=str(path))
    except JSONRefused as exc:
        raise _unreadable(path, exc.problem) from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT or not isinstance(raw.get("job"), str):
        raise _unreadable(path, f"not an owner marker of format {FORMAT!r}")
    claimed = raw.get("claimed_unix", 0.0)
    return Owner(
        job=raw["job"],
        claimed_unix=float(claimed) if isinstance(claimed, int | float) else 0.0,
        host=str(raw.get("host", "")),
        pid=int(raw["pid"]) if isinstance(raw.get("pid"), int) else 0,
    )


def check_owner(job_dir: Path, job: str) -> Owner | None:
    """Read-only: raise :class:`DirectoryOwnedError` if ``job_dir`` belongs to another job."""
    owner = read_owner(job_dir)
    if owner is not None and owner.job != job:
        raise _owned(job_dir, owner)
    return owner


def claim(job_dir: Path, job: str, *, now: Callable[[], float] = time.time) -> Owner:
    """Make ``job`` the owner of ``job_dir`` (created if missing) unless it has one; return the
    owner. Idempotent for the same job; raises :class:`DirectoryOwnedError` for another job's
    directory without writing anything there."""
    existing = check_owner(job_dir, job)
    if existing is not None:
        return existing
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"field 'checkpoint.dir': cannot create {job_dir}: {exc.strerror}") from None
    mine = Owner(job=job, claimed_unix=round(now(), 3), host=socket.gethostname(), pid=os.getpid())
    if not _create_once(job_dir / OWNER_FILE, mine.to_json().encode()):
        return check_owner(job_dir, job) or mine  # another claim came first: it decides
    fsync_dir(job_dir)
    return mine


def owned_by_other(job_dir: Path, job: str) -> Owner | None:
    """The owner of ``job_dir`` if it is not ``job`` (an unreadable marker counts as another
    owner: nothing is deleted on a guess)."""
    try:
        owner = read_owner(job_dir)
    except SpecError:
        return Owner(job="<unreadable marker>", claimed_unix=0.0)
    return owner if owner is not None and owner.job != job else None


def _create_once(target: Path, data: bytes) -> bool:
    """Create ``target`` with ``data`` unless it exists; whether this call created it."""
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    write_durable(tmp, data)
    try:
        os.link(tmp, target)  # atomic and exclusive: complete or absent, one winner
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
        return _create_exclusive(target, data)  # a filesystem without hard links
    finally:
        tmp.unlink(missing_ok=True)


def _create_exclusive(target: Path, data: bytes) -> bool:
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _owned(job_dir: Path, owner: Owner) -> DirectoryOwnedError:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.claimed_unix))
    return DirectoryOwnedError(
        f"field 'checkpoint.dir': {job_dir} belongs to job {owner.job!r} (claimed {when}, see "
        f"{job_dir / OWNER_FILE}); give this job its own directory, or start from that job's "
        f"checkpoint read-only with checkpoint.resume: {job_dir}"
    )


def _unreadable(path: Path, why: str) -> SpecError:
    return SpecError(
        f"{path}: the checkpoint directory's owner marker is unreadable ({why}); if no job uses this "
        "directory any more, delete the file"
    )
