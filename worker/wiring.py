"""What both run modes (:mod:`worker.main`, and peer mode's :mod:`worker.peer.run`) wire a rank
with: the job's checkpointer, the exit of a rank that failed (reported to the control plane
first when it launched us), the exit of a group stopped by a preemption, and the end of a run."""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from worker.checkpoint import Checkpointer
    from worker.jobspec.spec import JobSpec
    from worker.report.events import Events
    from worker.report.service_client import ServiceClient
    from worker.start.dist import DistInfo
    from worker.train.trainer import Trainer


def die(
    message: str,
    client: ServiceClient | None,
    *,
    line: str,
    rank: int,
    step: int | None,
    generation: int | None,
    restartable: bool = True,
    ranks: list[int] | tuple[int, ...] = (),
) -> NoReturn:
    """Exit 1 at once: a normal interpreter exit can hang in gloo's teardown (see dist.shutdown).
    ``restartable``: False tells the service that a restart cannot help (see
    :class:`~worker.errors.FinalCheckpointError`); ``ranks``: the ranks a timed-out collective
    waited for (the service's incident names them)."""
    if client is not None:
        from worker.report.service_client import attempt_id

        attempt = attempt_id(os.environ, generation)
        client.failed(line, rank=rank, step=step, attempt=attempt, restartable=restartable, ranks=ranks)
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


def preempted(client: ServiceClient | None, trainer: Trainer | None) -> NoReturn:
    """The group stopped on request and saved: report, then exit with
    :data:`worker.train.preemption.EXIT_PREEMPTED` without tearing the group down (see :func:`die`)."""
    from worker.train.preemption import EXIT_PREEMPTED

    if client is not None:
        client.close(drain_s=2.0)
    if trainer is not None and trainer.metrics is not None:
        trainer.metrics.close()
    exit_now(EXIT_PREEMPTED)


def exit_now(code: int) -> NoReturn:
    """End the process with ``code`` without the interpreter's teardown: about 1.6 s of a
    2-process torchrun launch here (dropping the modules torch, its compiler stack and sympy
    bring, with the two workers of a node on 2 cores), for no one's benefit once training is over.
    What a normal exit guarantees is done first, in its order: the interpreter's own
    ``threading._shutdown`` (the threading-atexit callbacks, which end idle
    ``ThreadPoolExecutor`` workers, then a join of the non-daemon threads: an async save's writer
    included), the ``atexit`` handlers (``logging``'s flush and ``weakref.finalize`` among them),
    and a flush of every Python file object still open (a user's data or model code that left one
    open loses nothing); then ``os._exit``. :func:`worker.wiring.die` exits at once for a failure; this is the
    end of a run."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in [o for o in gc.get_objects() if type(o) in _FILE_TYPES]:  # exact types: fast
        with contextlib.suppress(OSError, ValueError):  # closed, a broken pipe: nothing to say there
            stream.flush()
    os._exit(code)


_FILE_TYPES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
