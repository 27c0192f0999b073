"""The service's object storage: which of its own environment's variables reach a store, and
whether a job may keep its checkpoints there.

The service reads and writes S3 with what its own environment names, resolved as the worker
resolves it (:mod:`worker.checkpoint.credentials`, the AWS SDKs' chain): :data:`SECRET_VARS`
(keys), :data:`PLAIN_VARS` (where the store is) and :data:`LOCAL_VARS` (a profile, web
identity, container credentials: where credentials are found, not the credentials). A job whose
``checkpoint.dir`` or ``checkpoint.resume`` is ``s3://`` is accepted only when the service's
environment names a source (:func:`configured`) and the bucket answers (:meth:`ObjectStorage.check`);
its workers are given the same variables by the service (never through the job's own ``env``),
so on one machine they resolve the same credentials themselves (and refresh expiring ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from worker.checkpoint.credentials import PROFILE_VARS, WEB_IDENTITY_VARS
from worker.jobspec.location import S3Location

SECRET_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
"""The credentials: on Kubernetes a worker pod gets them from a Secret, never as plain values."""
PLAIN_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP")
"""Where the store is and how to reach it (not secret)."""
CONTAINER_VARS = ("AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
LOCAL_VARS = (*PROFILE_VARS, *WEB_IDENTITY_VARS, *CONTAINER_VARS, "AWS_EC2_METADATA_DISABLED")
"""Where credentials are found (files on this machine, this pod's identity): given to the nodes
on one machine only; on Kubernetes a worker pod has its own identity or the Secret's keys."""
NOT_CONFIGURED = (
    "this service has no object storage credentials; set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (and AWS_ENDPOINT_URL for a store other than AWS) in "
    "the service's environment (the chart: objectStorage.secret, or IAM roles for service "
    "accounts), or give a path inside the storage root"
)


def storage_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The object storage variables set (non-empty) in ``environ``. Pure."""
    return {name: environ[name] for name in (*PLAIN_VARS, *LOCAL_VARS, *SECRET_VARS) if environ.get(name)}


def configured(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` names a source of credentials: an access key and its secret, a
    profile (``AWS_PROFILE`` or a profile file), web identity (a token file and a role) or
    container credentials. Whether they resolve and the bucket takes them is
    :meth:`ObjectStorage.check`'s. Pure."""
    return bool(
        (environ.get("AWS_ACCESS_KEY_ID") and environ.get("AWS_SECRET_ACCESS_KEY"))
        or any(environ.get(n) for n in (*PROFILE_VARS, *CONTAINER_VARS))
        or (environ.get("AWS_WEB_IDENTITY_TOKEN_FILE") and environ.get("AWS_ROLE_ARN"))
    )


def is_s3(location: str | None) -> bool:
    return bool(location) and str(location).startswith("s3://")


def uses_object_storage(checkpoint_dir: str | None, resume: str | None) -> bool:
    """Whether a job with this checkpoint directory and resume source reads or writes S3."""
    return is_s3(checkpoint_dir) or is_s3(resume)


@dataclass(frozen=True, slots=True)
class ObjectStorage:
    """The service's access to object storage (None in its place: it has none)."""

    env: Mapping[str, str] = field(default_factory=dict)
    """The variables its workers are given (:func:`storage_env` of the service's environment)."""
    check_bucket: bool = True
    """Whether a submit lists the location once (a missing bucket or refused credentials is a
    422 naming the field, before anything is stored)."""

    def check(self, location: S3Location, *, field: str) -> None:
        """Raise :class:`~worker.errors.SpecError` naming ``field`` and the fix unless the
        service's credentials resolve (a profile that is not there...) and one listing of
        ``location`` succeeds with them (I/O: seconds at most)."""
        if self.check_bucket:
            from worker.checkpoint.storage import check_reachable

            check_reachable(location, field=field)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ObjectStorage | None:
        return cls(env=storage_env(environ)) if configured(environ) else None
