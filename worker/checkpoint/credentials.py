"""Where the object store is and who this process is to it, resolved as the AWS SDKs do
(torch-free).

One place decides for the worker and for the service: :func:`resolve` asks botocore's own chain
(``botocore.session``), so every way an AWS SDK is configured works here the same way:

- credentials: the environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_SESSION_TOKEN``), then the profile (``AWS_PROFILE``, default ``default``) in
  ``~/.aws/credentials`` and ``~/.aws/config`` (``AWS_SHARED_CREDENTIALS_FILE``,
  ``AWS_CONFIG_FILE``), including a profile's ``role_arn`` or ``credential_process``, then web
  identity (``AWS_WEB_IDENTITY_TOKEN_FILE`` and ``AWS_ROLE_ARN``: EKS's IAM roles for service
  accounts), then the container's and the instance's metadata;
- the endpoint: ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, then the profile's ``services``
  section or its ``endpoint_url`` (none: AWS itself);
- the region: ``AWS_REGION``, then ``AWS_DEFAULT_REGION`` or the profile's ``region``, else
  ``us-east-1``.

obstore signs the requests; it is handed the credentials through its ``credential_provider``
callback (:class:`CredentialSource`). Credentials that expire (an assumed role, web identity,
metadata) are asked for again every :data:`REASK` and botocore refreshes them before they
expire, so a long run never signs with stale ones.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from worker.errors import CheckpointError

if TYPE_CHECKING:
    from obstore.store import S3Credential

#: How long obstore may use one answer of a source whose credentials expire.
REASK = timedelta(minutes=5)
DEFAULT_REGION = "us-east-1"

#: The variables that say where the profile files are and which profile (not secret).
PROFILE_VARS = ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
#: The variables of web identity (EKS's IAM roles for service accounts; not secret: the token
#: is in the file).
WEB_IDENTITY_VARS = ("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME")


class CredentialsError(CheckpointError):
    """No credentials could be resolved, or the configuration names what does not exist. The
    message says what to set."""


@dataclass(frozen=True, slots=True)
class StoreAccess:
    """The resolved configuration of a client of the store."""

    endpoint: str | None
    """None: AWS itself."""
    region: str
    credentials: CredentialSource
    session: Any
    """The botocore session that resolved them (its clients share the same credentials)."""
    method: str
    """Where botocore found the credentials (``env``, ``shared-credentials-file``,
    ``config-file``, ``assume-role-with-web-identity``, ``container-role``, ``iam-role``...)."""


def pick_region(environ: Mapping[str, str], configured: str | None) -> str:
    """``AWS_REGION`` (which the SDKs read first), else botocore's (``AWS_DEFAULT_REGION`` or the
    profile's ``region``), else ``us-east-1``. Pure."""
    return environ.get("AWS_REGION") or configured or DEFAULT_REGION


def expiry(expires: bool, now: datetime) -> datetime | None:
    """When obstore asks the source again: never for credentials that do not expire, else
    after :data:`REASK`. Pure."""
    return now + REASK if expires else None


class CredentialSource:
    """obstore's ``credential_provider``: botocore's credentials, frozen at each call (botocore
    refreshes expiring ones ahead of their expiry)."""

    def __init__(self, credentials: Any) -> None:
        self._credentials = credentials
        self.expires = hasattr(credentials, "refresh_needed")  # botocore's RefreshableCredentials

    def check(self, method: str) -> None:
        """Obtain the credentials now (a role is assumed, metadata asked): raises
        :class:`CredentialsError` with the fix when that fails (I/O)."""
        try:
            self._credentials.get_frozen_credentials()
        except Exception as exc:  # botocore's errors and a token file that cannot be read
            first = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            raise CredentialsError(f"no credentials from {method}: {first}; {obtain_fix(method)}") from None

    def __call__(self) -> S3Credential:
        frozen = self._credentials.get_frozen_credentials()
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expiry(self.expires, datetime.now(UTC)),
        }


def obtain_fix(method: str) -> str:
    """What to check when credentials found by ``method`` cannot be obtained. Pure."""
    if method == "assume-role-with-web-identity":
        return (
            "check AWS_ROLE_ARN and the token in AWS_WEB_IDENTITY_TOKEN_FILE (on EKS: the "
            "ServiceAccount's role annotation and the role's trust policy)"
        )
    if method.startswith("assume-role") or method == "custom-process":
        return "check the profile's role_arn, source_profile or credential_process"
    return "check where the credentials come from (container or instance role), or set AWS_PROFILE"


def resolve() -> StoreAccess:
    """The endpoint, region and credentials of this process's environment and profile (I/O: the
    profile files; web identity and metadata answer over the network). Raises
    :class:`CredentialsError` with the fix."""
    import botocore.session
    from botocore.configprovider import ConfiguredEndpointProvider
    from botocore.exceptions import BotoCoreError, ProfileNotFound

    session = botocore.session.get_session()
    try:
        credentials = session.get_credentials()
        region = pick_region(os.environ, session.get_config_variable("region"))
        endpoint = None
        if not session.get_config_variable("ignore_configured_endpoint_urls"):
            # botocore's lookup of a configured endpoint (what ``create_client`` itself does)
            endpoint = ConfiguredEndpointProvider(
                full_config=session.full_config, scoped_config=session.get_scoped_config(), client_name="s3"
            ).provide()
    except ProfileNotFound as exc:
        raise CredentialsError(
            f"{exc} (AWS_PROFILE); add it to {_files()} or set AWS_PROFILE to one there"
        ) from None
    except BotoCoreError as exc:  # a profile that cannot be used (a role it cannot assume, ...)
        raise CredentialsError(f"{str(exc).splitlines()[0][:300]}; fix the profile in {_files()}") from None
    if credentials is None:
        raise CredentialsError(
            "no credentials found (environment, profile, web identity, container or instance "
            "metadata); set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
        )
    return StoreAccess(endpoint or None, region, CredentialSource(credentials), session, credentials.method)


def _files() -> str:
    config = os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")
    shared = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    return f"{config} or {shared}"
