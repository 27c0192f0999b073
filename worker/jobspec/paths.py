"""What the JobSpec's paths and environment may hold (torch-free, pure).

The schema (:mod:`worker.jobspec.spec`) applies these rules, so the service refuses a value at submit
(422 naming the field, before anything is stored) and a bare torchrun worker at its start (exit
2) with the same words. A path is a local one (no ``scheme://`` URL: only directories on this
machine or on a filesystem every node mounts are supported), of at most ``MAX_PATH_BYTES``
bytes, ``MAX_PATH_DEPTH`` components and ``MAX_NAME_BYTES`` bytes a component (Linux's own
``PATH_MAX`` and ``NAME_MAX``; no checkpoint layout needs a deeper tree). A checkpoint's location
(``checkpoint.dir``, ``checkpoint.resume``) may also be ``s3://BUCKET/PREFIX``
(:func:`worker.jobspec.location.parse_location`, which refuses every other scheme). ``checkpoint.resume``
is one of :data:`RESUME_KEYWORDS` or a path; a word or a number that looks like a keyword is
refused instead of being read as a directory that does not exist.
"""

from __future__ import annotations

import re

from worker.jobspec.location import is_url, parse_location

MAX_PATH_BYTES = 4095
MAX_PATH_DEPTH = 64
MAX_NAME_BYTES = 255
RESUME_KEYWORDS = ("auto", "never")
"""``auto``: the job's newest published checkpoint if it has one, else a fresh start; ``never``:
a fresh start. Any other value is the path of a checkpoint."""

_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_NOT_KEYWORDS = frozenset(
    {"latest", "last", "newest", "none", "null", "no", "off", "false", "true", "yes", "on", "default",
     "resume", "skip", "fresh"}
)  # fmt: skip
_RESUME_FORMS = (
    "give 'auto' (the job's newest published checkpoint if it has one, else a fresh start), "
    "'never' (a fresh start), or the path of a checkpoint: a step directory (step-NNNNNNNN) or "
    "a job's checkpoint directory (its newest published step)"
)


def check_local_path(value: str) -> str:
    """``value`` if it is a local path within the limits; else ValueError saying what to give."""
    if not value.strip():
        raise ValueError("is empty; give a directory, or leave the field out")
    if "\x00" in value:
        raise ValueError("holds a NUL byte, which no path can hold; give a plain path")
    if _URL_RE.match(value):
        raise ValueError(
            f"{value[:100]!r} is a URL; only local paths are supported (a directory on this machine "
            "or on a filesystem every node mounts); give a local path"
        )
    size = len(value.encode("utf-8"))
    if size > MAX_PATH_BYTES:
        raise ValueError(f"is {size} bytes long; give a path of at most {MAX_PATH_BYTES} bytes")
    names = [name for name in value.split("/") if name]
    if len(names) > MAX_PATH_DEPTH:
        raise ValueError(f"has {len(names)} components; give a path of at most {MAX_PATH_DEPTH} directories")
    for name in names:
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise ValueError(
                f"has a component of more than {MAX_NAME_BYTES} bytes ({name[:40]!r}...); shorten it"
            )
    return value


def check_location(value: str | None, *, field: str = "checkpoint.dir") -> str | None:
    """A checkpoint's location: ``s3://BUCKET/PREFIX`` (:func:`parse_location`; every other
    scheme is refused naming ``field``) or a local path (:func:`check_local_path`)."""
    if value is None:
        return None
    if is_url(value):
        if len(value.encode("utf-8")) > MAX_PATH_BYTES:
            raise ValueError(f"is longer than {MAX_PATH_BYTES} bytes; give a shorter location")
        parse_location(value, field=field)
        return value
    return check_local_path(value)


def check_resume(value: str) -> str:
    """``checkpoint.resume``: a keyword as is, else a location (:func:`check_location`); a
    keyword in other letters, a look-alike word or a bare number is refused with the forms the
    worker accepts."""
    if value in RESUME_KEYWORDS:
        return value
    word = value.strip().lower()
    if word in RESUME_KEYWORDS or word in _NOT_KEYWORDS or word.isdigit():
        raise ValueError(f"{value[:40]!r} is not a value the worker accepts; {_RESUME_FORMS}")
    checked = check_location(value, field="checkpoint.resume")
    assert checked is not None
    return checked


def check_env_value(name: str, value: str) -> str:
    """An ``env`` value a process environment can hold: no NUL byte (it ends a C string; the
    schema's strict strings already refuse unpaired surrogates, which have no bytes)."""
    if "\x00" in value:
        raise ValueError(
            f"the value of {name!r} holds a NUL byte, which a process environment cannot hold; remove it"
        )
    return value
