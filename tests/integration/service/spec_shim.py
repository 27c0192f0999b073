"""Until worker/spec.py has ``recovery`` and ``spares`` (the worker half of issue 14, merged
separately), add the two fields to :class:`worker.spec.JobSpec` in this process, with the names
and defaults of issue14-design.md for what the service reads (``recovery.mode``,
``recovery.max_incidents``, ``spares``). A no-op once the real fields exist; delete it then.

Call :func:`install` before anything imports the service (a record's schema embeds the spec's):
``svc_launcher.py`` does when ``ELASTRAIN_TEST_SPEC_SHIM=1``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic.fields import FieldInfo


def install() -> None:
    import worker.spec as spec

    if "recovery" in spec.JobSpec.model_fields:
        return

    class RecoverySpec(spec._Frozen):
        mode: Literal["auto", "peer", "restart"] = "auto"
        max_incidents: int | None = Field(default=None, ge=1)

    fields = {
        "recovery": (RecoverySpec, Field(default_factory=RecoverySpec)),
        "spares": (int, Field(default=0, ge=0, le=64)),
    }
    for name, (kind, info) in fields.items():
        spec.JobSpec.__annotations__[name] = kind
        spec.JobSpec.model_fields[name] = FieldInfo.from_annotated_attribute(kind, info)
    spec.JobSpec.model_rebuild(force=True)
