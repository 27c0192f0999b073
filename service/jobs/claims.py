"""Which job a checkpoint directory belongs to, as the service records it.

A job's checkpoint directory belongs to that job for good: its resume reads every ``step-*``
directory there and its retention deletes in it. The service records the claim in etcd under
``keys.dir_claim(<real path>)`` (a create-only write in the same transaction as the job record)
and writes the marker the workers check (:func:`worker.checkpoint.owner.claim`) at submit. A
directory is free for a new job when no other job claims it, no directory above it inside the
storage root (the new job's ``step-*`` would be read by that job's resume) and none below it
(that job's steps would look like the new job's), in etcd or by a marker on disk (a worker under
plain torchrun writes one). An ``s3://`` location is claimed the same way in etcd (its prefixes
within the bucket are the directories above it); it holds no marker. Starting from another
job's checkpoint is ``checkpoint.resume``, read-only; it needs no claim.
"""

from __future__ import annotations

import json
from pathlib import Path

from service.etcd.kv import KVStore, Write
from service.jobs import keys
from service.jobs.paths import PathError, Place
from worker.checkpoint.owner import read_owner
from worker.errors import SpecError
from worker.jobspec.location import S3Location

FIELD = "checkpoint.dir"


def claim_write(directory: Place, job_id: str, *, now: float) -> Write:
    """The create-only write that records ``job_id`` as the owner of ``directory``."""
    value = json.dumps({"job": job_id, "claimed_unix": round(now, 3)}).encode()
    return Write(keys.dir_claim(str(directory)), value, 0)


def check_free(store: KVStore, directory: Place, *, root: Path, job_id: str) -> None:
    """Raise :class:`PathError` (422 naming ``checkpoint.dir``) unless ``directory`` may become
    ``job_id``'s: see the module doc. Reads etcd and the markers on disk; writes nothing."""
    for place in (directory, *_between(directory, root)):
        owner = _claimed(store, place)
        if owner is not None and owner != job_id:
            raise _taken(directory, place, owner)
    for entry in store.list_prefix(keys.dir_claim(str(directory)) + "/"):
        owner = _owner_of(entry.value)
        if owner != job_id:
            inner = entry.key.removeprefix(keys.dir_claim(""))
            raise _taken(directory, _place(inner), owner)
    if isinstance(directory, S3Location):
        return
    for place in (directory, *[p for p in directory.parents if p != root and root in p.parents]):
        try:
            marker = read_owner(place)
        except SpecError as exc:
            raise PathError(FIELD, str(exc)) from None
        if marker is not None and marker.job != job_id:
            raise _taken(directory, place, marker.job)


def _between(directory: Place, root: Path) -> list[Place]:
    """The directories above ``directory`` up to (not including) ``root``; on S3 the prefixes
    above it in its bucket."""
    if isinstance(directory, S3Location):
        return _above(directory)
    return [p for p in directory.parents if p != root and root in p.parents]


def _above(loc: S3Location) -> list[Place]:
    out: list[Place] = []
    while loc.prefix:
        loc = loc.parent
        out.append(loc)
    return out


def _place(text: str) -> Place:
    return S3Location(*text[5:].partition("/")[::2]) if text.startswith("s3://") else Path(text)


def _claimed(store: KVStore, place: Place) -> str | None:
    found = store.get(keys.dir_claim(str(place)))
    return None if found is None else _owner_of(found.value)


def _owner_of(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["job"])
    except (ValueError, KeyError, TypeError):
        return "<unreadable claim>"


def _taken(directory: Place, place: Place, owner: str) -> PathError:
    if place == directory:
        where = f"{directory} belongs to job {owner!r}"
    elif place in _between(directory, Path("/")):
        where = f"{directory} lies inside {place}, which belongs to job {owner!r}"
    else:
        where = f"{directory} holds {place}, which belongs to job {owner!r}"
    return PathError(
        FIELD,
        f"{where}; give this job a directory of its own, or start from that job's checkpoint "
        f"read-only with checkpoint.resume: {place}",
    )
