"""The control plane's errors about jobs; :mod:`service.api.errors` maps each to one HTTP answer."""

from __future__ import annotations

from worker.errors import ElastrainError


class NotFoundError(ElastrainError):
    """No such job (or checkpoint)."""


class ConflictError(ElastrainError):
    """The request contradicts stored state (e.g. an idempotency key reused for another spec)."""


class InvalidRequestError(ElastrainError):
    """A well-formed request whose content the service cannot accept (422); ``field`` names the
    offending field when one is to blame."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotLeaderError(ElastrainError):
    """This service instance does not lead (any more); its write was not made. Retry (503)."""


class JobEndedError(ConflictError):
    """The job has ended; its workers' callbacks (and its worker token) no longer work (409)."""


class OverBudgetError(ElastrainError):
    """A job's workers sent more than their budget allows (429); ``retry_after`` in seconds."""

    def __init__(self, message: str, *, retry_after: float, budget: str) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.budget = budget
