"""What a submit refuses because it could never run here, beyond the JobSpec's own schema: one
function, :func:`admit`, that the submit route calls on the parsed spec (each refusal a
:class:`SpecError` naming the field and the fix, answered 422 before anything is stored)."""

from __future__ import annotations

from service.launch.resources import parse_resources
from service.settings import Settings
from worker.spec import JobSpec


def admit(spec: JobSpec, settings: Settings) -> None:
    """Raise :class:`SpecError` when ``spec`` cannot run under this service's ``settings``:
    ``resources`` no scheduler can use (the launch reads them with the same function)."""
    del settings  # the checks that depend on the service's settings follow
    parse_resources(spec.resources)
