"""The JobSpec's bounds and the rules of its ``env`` (torch-free): what :mod:`worker.jobspec.spec`
checks beyond types. docs/jobspec.md lists the bounds."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

MAX_NODES = 10_000
"""The most nodes a job may ask for (the scale route's cap too)."""
# Bounds of what a run can do at all, so that a value such as max_steps 1e30 or micro_batch_size
# 1e12 is refused at submit, naming the field, instead of failing wherever it is first used.
# docs/jobspec.md lists them.
MAX_STEPS = 10**9
MAX_MICRO_BATCH = 1 << 20
MAX_ACCUM = 1 << 16
MAX_GLOBAL_BATCH = 1 << 30
MAX_SAMPLES = 10**10
MAX_KWARGS = 64
MAX_TEXT = 4096

MAX_IMAGE = 255
MAX_ENV = 64
IMAGE_RE = r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$"
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_RESERVED_ENV_PREFIXES = ("ELASTRAIN_", "TORCH", "PET_")
_RESERVED_ENV = frozenset(
    {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
     "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONUNBUFFERED"}
)  # fmt: skip


def check_env_name(name: str) -> None:
    """A name ``JobSpec.env`` may set: a shell variable's, not one the service or torchrun sets
    for the node (``ELASTRAIN_*``, ``TORCH*``, ``RANK``, ``MASTER_ADDR``, ...)."""
    if not _ENV_NAME_RE.match(name):
        raise ValueError(
            f"{name[:80]!r} is not a variable name; give letters, digits and '_' (not first a digit)"
        )
    if name.upper().startswith(_RESERVED_ENV_PREFIXES) or name.upper() in _RESERVED_ENV:
        raise ValueError(
            f"{name!r} is set by the service or torchrun for every node and cannot be overridden; remove it"
        )


class Frozen(BaseModel):
    """The base of every JobSpec model. Finite numbers only: Python's json and pydantic's parser
    take NaN, Infinity and 1e999, which no optimizer, scaler or schedule can use and which JSON
    writes back as null."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
