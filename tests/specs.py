"""The smallest valid JobSpec for tests, in one place: an MLP on synthetic data, a micro-batch of
8, 10 steps. Each test states only what it changes."""

from __future__ import annotations

from typing import Any

from worker.jobspec.spec import JobSpec, parse_spec


def raw_spec(name: str = "job", **fields: Any) -> dict[str, Any]:
    """The spec as a client submits it (JSON), with ``fields`` set over the defaults."""
    base: dict[str, Any] = {
        "name": name,
        "model": {"name": "mlp"},
        "data": {"name": "synthetic"},
        "micro_batch_size": 8,
        "max_steps": 10,
    }
    return base | fields


def make_spec(name: str = "job", **fields: Any) -> JobSpec:
    """:func:`raw_spec`, parsed."""
    return parse_spec(raw_spec(name, **fields))
