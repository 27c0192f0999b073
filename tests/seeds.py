"""Seeds for the fault rows (``make faults``; one seed in ``make test``): from the environment.

``ELASTRAIN_FAULT_SEEDS="3,17"`` (what ``python -m scripts.faults`` sets) or
``ELASTRAIN_FAULT_SEED=3``; default ``1``. A row's test is parametrised by them (``seed=N`` in its
id, next to any other parameters); tests/conftest.py prints the seed of a failed trial.

A row with a list of cases (:func:`swept`) runs one case drawn from the seed in ``make test`` and
every case, each with every seed, under ``ELASTRAIN_FAULT_SWEEP=1`` (what ``make faults`` sets).
"""

from __future__ import annotations

import os
from typing import Any

import pytest


def fault_seeds() -> list[int]:
    """The seeds every row runs with, from the environment."""
    raw = os.environ.get("ELASTRAIN_FAULT_SEEDS") or os.environ.get("ELASTRAIN_FAULT_SEED") or "1"
    return [int(s) for s in raw.split(",") if s.strip()]


def sweeping() -> bool:
    """Whether every case runs (``ELASTRAIN_FAULT_SWEEP=1``, ``make faults``) or one drawn."""
    return os.environ.get("ELASTRAIN_FAULT_SWEEP") == "1"


def swept(cases: list[Any]) -> list[Any]:
    """A row's ``case`` parameter: every case under ``ELASTRAIN_FAULT_SWEEP=1``, else ``[None]``
    (the test draws its case from the seed)."""
    return list(cases) if sweeping() else [None]


def seeded(func: Any) -> Any:
    """Parametrise a row by the fault seeds (ids ``seed=N``)."""
    return pytest.mark.parametrize("seed", fault_seeds(), ids=lambda s: f"seed={s}")(func)
