"""The worker's entry point: validate everything that can be validated, then train.

Bad input (spec, options, batch that cannot be split, a model, data or loss that does not fit
the worker: see worker.contract) is one line on stderr and exit code 2, before any process group
starts. Under torchrun every rank runs this; outside it, one process. Under the service a rank
that stops reports why and at which step (a ``failed`` event), so that the same error in the
next attempt fails the job instead of spending its restarts.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import gc
import io
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from worker import startgc
from worker.errors import ElastrainError, SpecError

if TYPE_CHECKING:
    from collections.abc import Callable

    from worker.build import Built
    from worker.checkpoint import Checkpointer
    from worker.dist import DistInfo
    from worker.events import Events
    from worker.hangs import Store
    from worker.service_client import EventForwarder, ServiceClient
    from worker.spec import JobSpec
    from worker.trainer import Trainer

EXIT_BAD_INPUT = 2


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker", description="Run one elastrain worker.")
    parser.add_argument("--config", required=True, help="path to the JobSpec JSON")
    return parser.parse_args(argv)


def _resuming(checkpoint_dir: str | None, resume: str) -> bool:
    if resume == "never":
        return False
    if resume != "auto":
        return True
    if checkpoint_dir is None:
        return False
    from worker.checkpoint.layout import list_published

    # Not just `latest`: a kill between the publish rename and the `latest` update leaves a
    # published step that restore() will load.
    return bool(list_published(Path(checkpoint_dir)))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # Imported here so that `--help` and argument errors stay fast.
    from worker import lifeline, preemption

    preemption.install()  # from now on a SIGTERM is a graceful stop at the next step boundary

    if lifeline.should_install(os.environ):  # both modes: a worker dies with its torchrun agent
        lifeline.install()
    from worker.spec import load_spec

    try:  # before torch is imported (~4 s): a spec that cannot run says so at once
        spec = load_spec(args.config)
    except SpecError as exc:
        return _bad_input(exc)
    import torch

    from worker import dist, peermode
    from worker.build import build
    from worker.events import Events
    from worker.spec_recovery import restart_note

    try:
        env_dir = os.environ.get("ELASTRAIN_CHECKPOINT_DIR")
        if spec.checkpoint.dir is None and env_dir:  # the service's storage for this job
            spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"dir": env_dir})})
        gpus = torch.cuda.device_count()
        info = dist.detect(os.environ, backend=spec.ddp.backend, gpus=gpus)
        peer = peermode.peer_requested(os.environ)
        if (
            spec.checkpoint.dir is not None and not peer
        ):  # it belongs to this job, before anything is written there
            _own(Path(spec.checkpoint.dir), spec.name, main=info.is_main)
        events = Events(enabled=info.is_main and not peer, job=spec.name, rank=info.rank)
        if (info.is_main or peer) and spec.checkpoint.dir is not None:  # the run dir `elastrain report` reads
            events.log_path = _run_dir(spec.checkpoint.dir) / "events.jsonl"
        default_timeout = str(spec.recovery.collective_timeout_s) if peer else "300"
        timeout_s = _collective_timeout(os.environ.get("ELASTRAIN_COLLECTIVE_TIMEOUT_S", default_timeout))
        built = build(spec, info, resuming=_resuming(spec.checkpoint.dir, spec.checkpoint.resume))
        for note in (
            restart_note(spec.recovery.mode, launched_peer=peer),
            dist.backend_note(os.environ, info, backend=spec.ddp.backend, gpus=gpus),
        ):
            if note is not None:  # the run record says it; rank 0 says it once on stderr
                built = dataclasses.replace(built, notes=(*built.notes, note))
                if info.is_main:
                    print(f"elastrain worker: note: {note}", file=sys.stderr, flush=True)
    except SpecError as exc:
        return _bad_input(exc)
    client, forwarder = _service(info, events)
    if peer:
        from worker.peerrun import run_peer

        return run_peer(built, info, events=events, client=client, forwarder=forwarder, timeout_s=timeout_s)
    trainer: Trainer | None = None
    generation: int | None = None
    try:
        generation = dist.start_group(
            info,
            timeout_s=timeout_s,
            on_timeout=lambda line: _die(
                line + "\n", client, line=line, rank=info.rank, step=None, generation=None
            ),
        )
        trainer = _trainer(
            built, info, events=events, client=client, generation=generation, timeout_s=timeout_s
        )
        if info.world_size > 1:
            from worker.hangs import Beacon

            trainer.beacon = Beacon(_default_store(), rank=info.rank, world_size=info.world_size)
        trainer.start()
        startgc.release()
        trainer.run()
    except preemption.Preempted:
        _stopped(client, trainer)
    except BaseException as exc:
        text = f"elastrain worker (rank {info.rank}): error: {exc}\n"
        line = f"error: {exc}"
        if not isinstance(exc, ElastrainError):
            text = traceback.format_exc()
            line = text.strip().splitlines()[-1]
        step = trainer.progress.step if trainer is not None else None
        waited = _waited_for(trainer, events) if "timed out" in str(exc).lower() else None
        if waited:
            text, line = f"{text.rstrip()}\n{waited[0]}\n", f"{line}; {waited[0]}"
        ranks = waited[1] if waited else ()
        _die(text, client, line=line, rank=info.rank, step=step, generation=generation, ranks=ranks)
    assert trainer is not None
    if client is not None:
        client.close()
    if trainer.metrics is not None:
        trainer.metrics.close()
    del trainer  # the DDP reducer holds the group: release it before the group goes
    dist.shutdown()
    return 0


def _default_store() -> Store:
    from torch.distributed import distributed_c10d

    store: Store = distributed_c10d._get_default_store()
    return store


def _waited_for(trainer: Trainer | None, events: Events) -> tuple[str, list[int]] | None:
    """When this rank's collective inside a step timed out: the ranks it waited for, said as the
    event ``collective_timeout`` (written whatever this rank) and as one line. (A peer that
    died breaks the collective at once, and its node's exit names it.)"""
    beacon = trainer.beacon if trainer is not None else None
    if trainer is None or beacon is None or beacon.position <= 2 * beacon.completed:
        return None
    from worker.hangs import describe

    missing = beacon.missing()
    if not missing:
        return None
    events.record(
        "collective_timeout", step=trainer.progress.step + 1, rank=trainer.info.rank,
        missing_ranks=[a.rank for a in missing],
        last_completed_steps={str(a.rank): a.completed for a in missing},
    )  # fmt: skip
    return f"the collective waited for {describe(missing)}", [a.rank for a in missing]


def _stopped(client: ServiceClient | None, trainer: Trainer | None) -> NoReturn:
    """The group stopped on request and saved: report, then exit with
    :data:`worker.preemption.EXIT_PREEMPTED` without tearing the group down (see :func:`_die`)."""
    from worker.preemption import EXIT_PREEMPTED

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
    open loses nothing); then ``os._exit``. :func:`_die` exits at once for a failure; this is the
    end of a run."""
    threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    atexit._run_exitfuncs()
    for stream in [o for o in gc.get_objects() if type(o) in _FILE_TYPES]:  # exact types: fast
        with contextlib.suppress(OSError, ValueError):  # closed, a broken pipe: nothing to say there
            stream.flush()
    os._exit(code)


_FILE_TYPES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def _trainer(
    built: Built,
    info: DistInfo,
    *,
    events: Events,
    client: ServiceClient | None,
    generation: int,
    timeout_s: float,
) -> Trainer:
    """The Trainer, complete: its checkpointer, this group's generation and its metrics."""
    from worker.checkpoint.owner import job_identity
    from worker.metrics import WorkerMetrics
    from worker.trainer import Trainer

    spec = built.spec
    job = job_identity(os.environ, spec.name)
    return Trainer(
        built,
        info,
        events=events,
        checkpointer=_checkpointer(spec, info, events, client, generation, timeout_s),
        generation=generation,
        metrics=WorkerMetrics.from_env(job=job, rank=info.rank, world_size=info.world_size),
    )


def _own(job_dir: Path, name: str, *, main: bool) -> None:
    """Rank 0 claims the checkpoint directory for this job, the others check it (a directory
    another job owns is a SpecError naming checkpoint.dir: see worker.checkpoint.owner)."""
    from worker.checkpoint.owner import check_owner, claim, job_identity

    (claim if main else check_owner)(job_dir, job_identity(os.environ, name))


def _collective_timeout(raw: str) -> float:
    """How long a collective, and each start-up wait (store, round, group, generation, restore
    agreement), may wait for a peer (a stopped or hung rank) before the group fails and torchrun
    restarts it from the newest checkpoint."""
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SpecError(f"ELASTRAIN_COLLECTIVE_TIMEOUT_S={raw!r} must be a positive number of seconds")
    return value


def _run_dir(path: str) -> Path:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"field 'checkpoint.dir': cannot create {path!r}: {exc.strerror}") from None
    return Path(path)


def _service(info: DistInfo, events: Events) -> tuple[ServiceClient | None, EventForwarder | None]:
    """The control plane's client when the service launched us (see worker.service_client), and
    the sink that reports this rank's events to it."""
    from worker import service_client

    client = service_client.from_env()
    if client is None:
        return None, None
    client.heartbeat_from(info.local_rank)
    forwarder = service_client.forward_events(
        client, rank=info.rank, world_size=info.world_size, env=os.environ
    )
    events.sinks.append(forwarder)
    return client, forwarder


def _bad_input(exc: SpecError) -> int:
    print(f"elastrain worker: error: {exc}", file=sys.stderr)
    _refused(f"error: {exc}")
    return EXIT_BAD_INPUT


def _refused(line: str) -> None:
    """Bad input under the service: say so before exiting 2 (torchrun will start this rank again,
    and the service fails the job when the next attempt says the same)."""
    from worker import service_client

    client = service_client.from_env()
    if client is None:
        return
    raw_rank = os.environ.get("RANK", "0")
    client.failed(
        line,
        rank=int(raw_rank) if raw_rank.isdigit() else 0,
        step=None,
        attempt=service_client.attempt_id(os.environ, None),
    )
    client.close(drain_s=2.0)


def _die(
    message: str,
    client: ServiceClient | None,
    *,
    line: str,
    rank: int,
    step: int | None,
    generation: int | None,
    ranks: list[int] | tuple[int, ...] = (),
) -> NoReturn:
    """Exit 1 at once: a normal interpreter exit can hang in gloo's teardown (see dist.shutdown).
    ``ranks``: the ranks a timed-out collective waited for (the service's incident names them)."""
    if client is not None:
        from worker.service_client import attempt_id

        client.failed(line, rank=rank, step=step, attempt=attempt_id(os.environ, generation), ranks=ranks)
        client.close(drain_s=2.0)
    sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)


def _checkpointer(
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
    from worker.service_client import HttpCoordinator
    from worker.setup import spec_hash

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
