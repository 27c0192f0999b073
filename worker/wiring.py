"""What both run modes (:mod:`worker.main`, and peer mode's :mod:`worker.peer.run`) wire a rank
with: the job's checkpointer, and the exit of a rank that failed (reported to the control plane
first when it launched us)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from worker.checkpoint import Checkpointer
    from worker.jobspec.spec import JobSpec
    from worker.report.events import Events
    from worker.report.service_client import ServiceClient
    from worker.start.dist import DistInfo


def die(
    message: str,
    client: ServiceClient | None,
    *,
    line: str,
    rank: int,
    step: int | None,
    generation: int | None,
    restartable: bool = True,
) -> NoReturn:
    """Exit 1 at once: a normal interpreter exit can hang in gloo's teardown (see dist.shutdown).
    ``restartable``: False tells the service that a restart cannot help (see
    :class:`~worker.errors.FinalCheckpointError`)."""
    if client is not None:
        from worker.report.service_client import attempt_id

        attempt = attempt_id(os.environ, generation)
        client.failed(line, rank=rank, step=step, attempt=attempt, restartable=restartable)
        client.close(drain_s=2.0)
    sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def job_checkpointer(
    spec: JobSpec,
    info: DistInfo,
    events: Events,
    client: ServiceClient | None,
    generation: int,
    timeout_s: float,
    abandon: Callable[[], str | None] | None = None,
    open_on_thread: bool = False,
    after: Checkpointer | None = None,
) -> Checkpointer | None:
    """The job's checkpointer (the service coordinates publishing when it launched us), or None
    when the spec has no checkpoint directory. Its waits for the other ranks (the restore
    agreement, a save's reports) end after the collective timeout, like a collective's, or, for
    a save's outcome, once ``abandon`` gives a reason (see :class:`HttpCoordinator`).
    ``open_on_thread``, ``after``: see :class:`~worker.checkpoint.Checkpointer`."""
    if spec.checkpoint.dir is None:
        return None
    from worker.checkpoint import Checkpointer
    from worker.checkpoint.owner import job_identity
    from worker.report.service_client import HttpCoordinator
    from worker.start.parts import spec_hash

    return Checkpointer(
        spec.checkpoint,
        job=job_identity(os.environ, spec.name),
        spec_hash=spec_hash(spec),
        data_version=spec.data.version,
        rank=info.rank,
        world_size=info.world_size,
        generation=generation,
        parallelism=spec.parallelism,
        seed=spec.seed,
        run_record={},
        coordinator=HttpCoordinator(client, abandon=abandon) if client is not None else None,
        timeout_s=timeout_s,
        on_event=lambda name, fields: events.emit(name, **fields),
        open_on_thread=open_on_thread,
        after=after,
    )
