"""The README's JobSpec reference is the schema's: every field once, its type, bounds and default
as ``worker.jobspec.spec.JobSpec`` declares them, and a description for each (scripts/jobspec_table.py
generates the table; ``python -m scripts.jobspec_table --write`` refreshes it)."""

from __future__ import annotations

from scripts.jobspec_table import DESCRIPTIONS, README, current, fields, table


def test_the_readme_table_is_the_schemas() -> None:
    assert current(README.read_text(encoding="utf-8")) == table(), (
        "README.md's JobSpec table differs from the schema: run python -m scripts.jobspec_table --write"
    )


def test_every_field_is_listed_once_and_described() -> None:
    rows = list(fields())
    paths = [f.path for f in rows]
    assert len(paths) == len(set(paths))
    assert {"log_every_steps", "data.dtype", "checkpoint.async", "recovery.mode"} <= set(paths)
    assert [f.path for f in rows if not f.description] == []


def test_a_description_is_in_one_place_and_names_a_field() -> None:
    rows = list(fields())
    assert sorted(set(DESCRIPTIONS) - {f.path for f in rows}) == [], "descriptions of fields the schema lacks"
    both = [f.path for f in rows if f.in_schema and f.path in DESCRIPTIONS]
    assert both == [], "described both in the schema and in scripts/jobspec_table.py"
