"""What the checkpoint duties answer, typed: the routes serialise these as they are, and etcd
keeps the outcome of a save and the registry's entries as their JSON."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Answer(BaseModel):
    """An answer the API sends: the declared fields are always there; a rank's load plan adds
    ``ops`` (see :class:`RankLoadPlan`)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class CheckpointOutcome(_Answer):
    """Where one reported step stands (the fields of ``worker.checkpoint.coordinator.Outcome``)."""

    status: Literal["pending", "published", "aborted"]
    published: bool
    step: int
    generation: int
    reason: str
    path: str | None = Field(description="The published step's directory.")

    @classmethod
    def of(
        cls,
        status: Literal["pending", "published", "aborted"],
        step: int,
        generation: int,
        reason: str,
        path: str | None = None,
    ) -> CheckpointOutcome:
        return cls(
            status=status,
            published=status == "published",
            step=step,
            generation=generation,
            reason=reason,
            path=path,
        )


class PublishClaim(BaseModel):
    """Held in a step's outcome key while one service instance publishes it."""

    model_config = ConfigDict(frozen=True)

    status: Literal["publishing"] = "publishing"
    by: str
    """The publishing instance."""
    at: float
    """When it claimed the step (its clock)."""


OutcomeRecord = Annotated[CheckpointOutcome | PublishClaim, Field(discriminator="status")]
OUTCOME_RECORD: TypeAdapter[CheckpointOutcome | PublishClaim] = TypeAdapter(OutcomeRecord)
"""Decodes an outcome key's value: a final outcome, or a publish in progress."""


class CheckpointEntry(_Answer):
    """One published checkpoint as ``GET /v1/jobs/{id}/checkpoints`` lists it."""

    step: int
    generation: int
    world_size: int
    bytes: int
    files: int
    published_at: float
    verified: bool
    dir: str


class RegistryEntry(CheckpointEntry):
    """What the registry keeps in etcd per published step: the entry and the step's metrics
    (retention's ``best_metric``)."""

    metrics: dict[str, float] = Field(default_factory=dict)

    def public(self) -> CheckpointEntry:
        return CheckpointEntry(**self.model_dump(exclude={"metrics"}))


class ResumeCheckpoint(_Answer):
    step: int
    dir: str
    world_size: int = Field(description="The world size it was saved at.")
    generation: int
    bytes: int
    reshard: bool = Field(description="True when the requested world size differs from the saved one.")


class RankLoadPlan(_Answer):
    """What one rank reads; with ``rank`` given, ``ops`` lists every read."""

    reads: int
    bytes: int
    files: list[str]


class ResumeAnswer(BaseModel):
    job: str
    checkpoint: ResumeCheckpoint | None = Field(
        description="The newest verified checkpoint; null: start fresh."
    )
    load_plan: dict[str, RankLoadPlan] | None = Field(description="Rank -> its reads, for ?world_size=.")
