"""Where a checkpoint lives: a local directory or an S3 bucket and prefix (pure, torch-free).

``checkpoint.dir`` and ``checkpoint.resume`` take a path or ``s3://BUCKET/PREFIX``; any other
``scheme://`` is refused with one line naming the field, so that a URL is never taken for a
relative directory (``s3:/bucket/...`` under the working directory). The JobSpec, the worker and
the offline commands all read a location through :func:`parse_location`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# S3's bucket naming rules: 3-63 of lower-case letters, digits, dots and hyphens.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


@dataclass(frozen=True, slots=True)
class S3Location:
    """``s3://bucket/prefix``: ``prefix`` has no leading or trailing slash ('' for the bucket's top)."""

    bucket: str
    prefix: str

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under the prefix, joined with '/'."""
        return "/".join(p for p in (self.prefix, *parts) if p)

    def child(self, name: str) -> S3Location:
        return S3Location(self.bucket, self.key(name))

    def __truediv__(self, name: str) -> S3Location:
        return self.child(name)

    @property
    def name(self) -> str:
        return self.prefix.rsplit("/", 1)[-1]

    @property
    def parent(self) -> S3Location:
        return S3Location(self.bucket, self.prefix.rsplit("/", 1)[0] if "/" in self.prefix else "")

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def is_url(text: str) -> bool:
    """Whether ``text`` starts with a ``scheme://``."""
    return _SCHEME.match(text) is not None


def parse_location(text: str, *, field: str = "checkpoint.dir") -> S3Location | None:
    """An :class:`S3Location` for ``s3://...``, None for a local path. Raises ValueError (one
    line naming ``field`` and the fix) for another scheme, a bad bucket name or a prefix with
    empty, ``.`` or ``..`` parts."""
    match = _SCHEME.match(text)
    if match is None:
        return None
    scheme = match.group(1).lower()
    if scheme != "s3":
        raise ValueError(
            f"{field}: {scheme}:// is not supported; give a local directory or s3://BUCKET/PREFIX"
        )
    rest = text[match.end() :]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise ValueError(
            f"{field}: {bucket!r} is not a valid S3 bucket name (3-63 lower-case letters, digits, '.', '-'); "
            "write s3://BUCKET/PREFIX"
        )
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(
            f"{field}: the prefix {prefix!r} has an empty, '.' or '..' part; write s3://BUCKET/a/b"
        )
    return S3Location(bucket, str(PurePosixPath(*parts)) if parts else "")
