"""Object storage for checkpoints: one small interface, an S3 implementation (torch-free).

:class:`Storage` is what a checkpoint needs of a store: list, read a range, write an object
(multipart, parallel, from a byte view without copying it), create an object only if it does not
exist (``If-None-Match: *``), replace one only if it is unchanged (``If-Match`` on its ETag), and
delete. Keys are full object keys in one bucket. :class:`S3Storage` speaks S3 through obstore (the
object_store crate: request signing, retries with backoff, multipart); the endpoint, region and
credentials are resolved as the AWS SDKs do (:mod:`worker.checkpoint.credentials`: the
environment, a profile, web identity, metadata). A local directory keeps its own code path
(``layout.py``, ``shardio.py``): fsync and rename, no extra copies.

A writer killed during a multipart upload leaves the upload open: its parts are stored (and
billed) but no listing of objects shows them. obstore has no call for that, so :meth:`uploads`
and :meth:`abort_uploads` (ListMultipartUploads, AbortMultipartUpload) go through botocore with
the same resolved configuration; nothing else does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError, NotFoundError, PreconditionError
from obstore.store import S3Store

from worker.checkpoint.credentials import CredentialsError, StoreAccess, resolve
from worker.errors import CheckpointError, SpecError
from worker.jobspec.location import S3Location

#: The size of one upload part; an upload holds at most ``PARTS_IN_FLIGHT`` of them at a time.
PART_SIZE = 16 << 20
PARTS_IN_FLIGHT = 4


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    etag: str


@dataclass(frozen=True, slots=True)
class Upload:
    """A multipart upload that was started and neither completed nor aborted."""

    key: str
    upload_id: str


class Storage(Protocol):
    """A checkpoint store (one bucket). Every method raises :class:`StorageError` on a
    failure of the store (after the client's own retries)."""

    def listing(self, prefix: str = "", *, recursive: bool = False) -> tuple[list[str], list[ObjectInfo]]:
        """(sub-prefixes, objects) directly under ``prefix`` (everything under it if recursive)."""
        ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes: ...

    def read_into(self, key: str, offset: int, view: memoryview) -> None:
        """Fill ``view`` with the object's bytes from ``offset`` (one ranged read)."""
        ...

    def write(self, key: str, data: memoryview | bytes) -> str:
        """Write (or overwrite) an object, multipart when large; returns its ETag."""
        ...

    def create(self, key: str, data: bytes) -> str | None:
        """Create ``key`` only if absent; its ETag, or None if it exists already."""
        ...

    def replace(self, key: str, data: bytes, etag: str) -> str | None:
        """Replace ``key`` only if its ETag is still ``etag``; the new ETag, or None if it changed."""
        ...

    def delete(self, keys: list[str]) -> None: ...

    def uploads(self, prefix: str) -> list[Upload]:
        """The open multipart uploads of keys that start with ``prefix``."""
        ...

    def abort_uploads(self, uploads: list[Upload]) -> None:
        """Abort ``uploads`` (their stored parts are freed); one already gone is not an error."""
        ...


class StorageError(CheckpointError):
    """The store failed or refused a request (after retries)."""


class S3Storage:
    """:class:`Storage` on an S3 bucket, through obstore."""

    def __init__(
        self, bucket: str, *, retries: int = 5, timeout_s: float = 60.0, access: StoreAccess | None = None
    ) -> None:
        """``access``: what :func:`~worker.checkpoint.credentials.resolve` answered, when the
        caller has it; else resolved here. Raises :class:`StorageError` when no credentials
        resolve."""
        self.location = S3Location(bucket, "")
        try:
            self.access = access = access if access is not None else resolve()
        except CredentialsError as exc:
            raise StorageError(f"{self.location}: {exc}") from None
        options: dict[str, object] = {"timeout": f"{int(timeout_s)}s", "connect_timeout": "5s"}
        config: dict[str, object] = {"region": access.region}
        if access.endpoint:
            config["endpoint"] = access.endpoint
            options["allow_http"] = access.endpoint.startswith("http://")
        self._store = S3Store(
            bucket,
            config=config,  # type: ignore[arg-type]
            client_options=options,  # type: ignore[arg-type]
            retry_config={"max_retries": retries, "retry_timeout": timedelta(seconds=timeout_s)},
            credential_provider=access.credentials,
        )
        self._retries, self._timeout_s = retries, timeout_s
        self._multipart: Any = None

    def _key(self, key: str) -> str:
        return key

    def _rel(self, path: str) -> str:
        return path

    def listing(self, prefix: str = "", *, recursive: bool = False) -> tuple[list[str], list[ObjectInfo]]:
        full = self._key(prefix)
        full = f"{full}/" if full else ""
        try:
            if recursive:
                objects = [m for batch in obstore.list(self._store, prefix=full) for m in batch]
                dirs: list[str] = []
            else:
                got = obstore.list_with_delimiter(self._store, prefix=full)
                objects, dirs = (
                    list(got["objects"]),
                    [self._rel(p.rstrip("/")) for p in got["common_prefixes"]],
                )
        except BaseError as exc:
            raise _error(self.location, exc) from None
        # Some stores (SeaweedFS) list a directory marker named like the prefix: not an object under it.
        objects = [m for m in objects if m["path"].startswith(full)]
        return dirs, [ObjectInfo(self._rel(m["path"]), m["size"], m["e_tag"] or "") for m in objects]

    def head(self, key: str) -> ObjectInfo | None:
        try:
            m = obstore.head(self._store, self._key(key))
        except FileNotFoundError:
            return None
        except NotFoundError:
            return None
        except BaseError as exc:
            raise _error(self.location, exc) from None
        return ObjectInfo(key, m["size"], m["e_tag"] or "")

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        try:
            if start == 0 and end is None:
                return obstore.get(self._store, self._key(key)).bytes().to_bytes()
            assert end is not None
            return obstore.get_range(self._store, self._key(key), start=start, end=end).to_bytes()
        except (FileNotFoundError, NotFoundError):
            raise StorageError(f"{self.location}/{key}: no such object") from None
        except BaseError as exc:
            raise _error(self.location, exc) from None

    def read_into(self, key: str, offset: int, view: memoryview) -> None:
        data = self.read(key, offset, offset + len(view))
        if len(data) != len(view):
            raise StorageError(f"{self.location}/{key} offset {offset}: short read (truncated?)")
        view[:] = data

    def write(self, key: str, data: memoryview | bytes) -> str:
        try:
            got = obstore.put(
                self._store, self._key(key), data, chunk_size=PART_SIZE, max_concurrency=PARTS_IN_FLIGHT
            )
        except BaseError as exc:
            raise _error(self.location, exc) from None
        return got["e_tag"] or ""

    def create(self, key: str, data: bytes) -> str | None:
        try:
            return obstore.put(self._store, self._key(key), data, mode="create")["e_tag"] or ""
        except AlreadyExistsError:
            return None
        except BaseError as exc:
            raise _error(self.location, exc) from None

    def replace(self, key: str, data: bytes, etag: str) -> str | None:
        try:
            return obstore.put(self._store, self._key(key), data, mode={"e_tag": etag})["e_tag"] or ""
        except PreconditionError:
            return None
        except BaseError as exc:
            raise _error(self.location, exc) from None

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            obstore.delete(self._store, [self._key(k) for k in keys])
        except (FileNotFoundError, NotFoundError):
            pass
        except BaseError as exc:
            raise _error(self.location, exc) from None

    def uploads(self, prefix: str) -> list[Upload]:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            pages = self._multipart_client().get_paginator("list_multipart_uploads")
            found = pages.paginate(Bucket=self.location.bucket, Prefix=prefix)
            return [Upload(u["Key"], u["UploadId"]) for page in found for u in page.get("Uploads", [])]
        except (BotoCoreError, ClientError) as exc:
            raise _error(self.location, exc) from None

    def abort_uploads(self, uploads: list[Upload]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        for u in uploads:
            try:
                self._multipart_client().abort_multipart_upload(
                    Bucket=self.location.bucket, Key=u.key, UploadId=u.upload_id
                )
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":
                    raise _error(self.location, exc) from None
            except BotoCoreError as exc:
                raise _error(self.location, exc) from None

    def _multipart_client(self) -> Any:
        """botocore's S3 client (made on first use) with the resolved endpoint, region and
        credentials, path-style requests as obstore makes them."""
        if self._multipart is None:
            from botocore.config import Config

            config = Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": self._retries, "mode": "standard"},
                connect_timeout=5,
                read_timeout=self._timeout_s,
            )
            self._multipart = self.access.session.create_client(
                "s3", region_name=self.access.region, endpoint_url=self.access.endpoint, config=config
            )
        return self._multipart


def _error(location: S3Location, exc: BaseException) -> StorageError:
    text = str(exc)
    return StorageError(f"{location}: {_short(text)}")


def _short(text: str) -> str:
    """The S3 error code and status out of the client's many-line message."""
    for code in ("NoSuchBucket", "SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"):
        if code in text:
            return code
    return text.splitlines()[0][:300] if text else "storage error"


def check_reachable(location: S3Location, *, field: str = "checkpoint.dir") -> None:
    """One listing of the prefix, with few retries: raises :class:`SpecError` (one line naming
    ``field`` and the fix) for credentials that do not resolve (a profile that is not there) or
    cannot be obtained (a role that refuses the web identity token), a missing bucket, refused
    credentials or an unreachable endpoint. Run before any rank waits on another."""
    try:
        access = resolve()
        access.credentials.check(access.method)
    except CredentialsError as exc:
        raise SpecError(f"field '{field}': {location}: {exc}") from None
    try:
        S3Storage(location.bucket, retries=1, timeout_s=10, access=access).listing(location.prefix)
    except StorageError as exc:
        fix = unreachable_fix(str(exc).rsplit(": ", 1)[-1], location, access.endpoint, access.method)
        raise SpecError(f"field '{field}': {location}: {fix}") from None


def unreachable_fix(code: str, location: S3Location, endpoint: str | None, method: str) -> str:
    """What to do about a listing the store answered with ``code`` (:func:`_short`), for a
    client of ``endpoint`` (None: AWS) whose credentials came from ``method``. Pure."""
    where = endpoint or "AWS's default endpoint"
    if code == "NoSuchBucket":
        return f"bucket {location.bucket!r} does not exist at {where}; create it or fix the name"
    if code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"):
        found = "" if method == "env" else f" (found by botocore: {method})"
        return (
            f"{code}: the store refused the credentials{found}; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or fix the profile AWS_PROFILE names"
        )
    return (
        f"cannot reach the store at {where} ({code[:200]}); set AWS_ENDPOINT_URL or the profile's "
        "endpoint_url"
    )


_stores: dict[str, S3Storage] = {}


def storage_for(location: S3Location) -> S3Storage:
    """The process's client for ``location``'s bucket (one connection pool per bucket)."""
    store = _stores.get(location.bucket)
    if store is None:
        store = _stores[location.bucket] = S3Storage(location.bucket)
    return store
