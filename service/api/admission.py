"""What a submit refuses because it could never run here, beyond the JobSpec's own schema: one
function, :func:`admit`, that the submit route calls on the parsed spec (each refusal a
:class:`SpecError` naming the field and the fix, answered 422 before anything is stored)."""

from __future__ import annotations

from service.jobs import peer, queue
from service.jobs.resources import parse_resources
from service.launch import gpus, hostgpus
from service.launch.threads import host_slots
from service.settings import Settings
from worker.errors import SpecError
from worker.jobspec.spec import JobSpec


def admit(spec: JobSpec, settings: Settings) -> tuple[str, ...]:
    """Raise :class:`SpecError` when ``spec`` cannot run under this service's ``settings``:
    ``resources`` no scheduler can use (the launch reads them with the same function); a
    factory from a module the service does not allow (``ELASTRAIN_FACTORY_ALLOWLIST``); spares
    for a job that does not recover from its peers (:func:`service.jobs.peer.check`); NCCL for
    a job whose nodes will not see this machine's GPUs (:func:`service.launch.gpus.check`); a job
    whose minimum size exceeds the local scheduler's slots (:func:`service.jobs.queue.check`).
    Returns what the submitted event adds (where the local scheduler's nodes train)."""
    parse_resources(spec.resources)
    peer.check(spec)
    reason = None
    if settings.scheduler == "local_cwd":
        reason = gpus.check(spec, hostgpus.host_gpus())
        queue.check(spec, host_slots(settings.local_slots))
    notes = (reason,) if reason is not None else ()
    allowed = settings.factory_prefixes
    if allowed is None:
        return notes
    for field, factory in factories(spec):
        if not factory_allowed(factory, allowed):
            raise SpecError(f"field '{field}': {_not_allowed(factory, allowed)}")
    return notes


def factories(spec: JobSpec) -> list[tuple[str, str]]:
    """Every ``pkg.mod:fn`` the workers of ``spec`` would import and call, with its field."""
    found = [("model.factory", spec.model.factory), ("data.factory", spec.data.factory)]
    if spec.loss is not None:
        found.append(("loss.factory", spec.loss.factory))
    return [(field, factory) for field, factory in found if factory is not None]


def factory_allowed(factory: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the module of ``factory`` is one of ``prefixes`` or inside one (whole names:
    ``team_a`` covers ``team_a.models``, not ``team_ab``). Pure."""
    module = factory.split(":", 1)[0]
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _not_allowed(factory: str, prefixes: tuple[str, ...]) -> str:
    if not prefixes:
        return (
            f"{factory!r}: this service runs built-in models and data only (ELASTRAIN_FACTORY_ALLOWLIST "
            "is empty); use a built-in ('name': 'mlp' | 'tiny-gpt', 'synthetic' | 'tokens'), or ask "
            "the operator to list your package"
        )
    return (
        f"{factory!r} is not from a module this service allows (ELASTRAIN_FACTORY_ALLOWLIST: "
        f"{', '.join(prefixes)}); use one of those packages, a built-in, or ask the operator to "
        "list yours"
    )
