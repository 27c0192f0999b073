"""The control plane's errors about jobs; :mod:`service.api.errors` maps each to one HTTP answer."""

from __future__ import annotations

from worker.errors import ElastrainError


class NotFoundError(ElastrainError):
    """No such job (or checkpoint)."""


class ConflictError(ElastrainError):
    """The request contradicts stored state (e.g. an idempotency key reused for another spec)."""


class InvalidRequestError(ElastrainError):
    """A well-formed request whose content the service cannot accept (422)."""


class NotLeaderError(ElastrainError):
    """This service instance does not lead (any more); its write was not made. Retry (503)."""
