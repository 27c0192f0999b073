"""One error hierarchy for the worker and the service (torch-free)."""

from __future__ import annotations


class ElastrainError(Exception):
    """Base of every error elastrain raises on purpose; its message is for a person."""


class SpecError(ElastrainError):
    """A job spec that cannot run: the message names the field and the fix."""


class CheckpointError(ElastrainError):
    """A checkpoint that cannot be written, verified or loaded."""


class CorruptCheckpointError(CheckpointError):
    """A published checkpoint whose bytes do not match its manifest."""


class FinalCheckpointError(CheckpointError):
    """The run trained to its end but its final checkpoint could not be published. A restart
    would train the same steps again towards the same save (a full volume stays full): the
    service fails the job at once instead of restarting it."""


class ReplicaMismatchError(ElastrainError):
    """Data-parallel replicas that must be bit-identical are not (a silent corruption): the
    group stops before it saves anything, and its restart resumes from the newest published
    checkpoint, which the replicas agreed on before it was saved. ``ranks``: those that disagree
    with the majority (every rank when there is none)."""

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks
