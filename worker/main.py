"""The worker's entry point: validate everything that can be validated, then train.

Bad input (spec, options, batch that cannot be split, a model, data or loss that does not fit
the worker: see worker.start.contract) is one line on stderr and exit code 2, before any process group
starts. Under torchrun every rank runs this; outside it, one process. Under the service a rank
that stops reports why and at which step (a ``failed`` event), so that the same error in the
next attempt fails the job instead of spending its restarts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from worker.errors import ElastrainError, FinalCheckpointError, ReplicaMismatchError, SpecError
from worker.start import startgc
from worker.wiring import die, job_checkpointer, preempted

if TYPE_CHECKING:
    from collections.abc import Callable

    from worker.report.events import Events
    from worker.report.service_client import EventForwarder, ServiceClient
    from worker.start.build import Built
    from worker.start.dist import DistInfo
    from worker.start.hangs import Store
    from worker.train.trainer import Trainer

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
    from worker.checkpoint.places import list_published, place_of

    # Not just `latest`: a kill between the publish rename and the `latest` update leaves a
    # published step that restore() will load.
    return bool(list_published(place_of(checkpoint_dir)))


def _replace_needs_peer(action: str) -> None:
    """Refuse ``stragglers.action: replace`` in a launch without peer recovery (a bare torchrun)."""
    from worker.jobspec.recovery import peer_requested, refuse_replace

    why = "this worker was not started by the service in peer mode (a bare torchrun)"
    refused = refuse_replace(action, peer=peer_requested(os.environ), why=why)
    if refused is not None:
        raise SpecError(refused)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    # Imported here so that `--help` and argument errors stay fast.
    from worker.start import lifeline
    from worker.train import preemption

    preemption.install()  # from now on a SIGTERM is a graceful stop at the next step boundary

    if lifeline.should_install(os.environ):  # both modes: a worker dies with its torchrun agent
        lifeline.install()
    from worker.jobspec.spec import load_spec

    try:  # before torch is imported (~4 s): a spec that cannot run says so at once
        spec = load_spec(args.config)
        _replace_needs_peer(spec.stragglers.action)
    except SpecError as exc:
        return _bad_input(exc)
    import torch

    from worker.jobspec.recovery import restart_note
    from worker.peer import member as peermode
    from worker.report.events import Events
    from worker.start import dist
    from worker.start.build import build

    try:
        env_dir = os.environ.get("ELASTRAIN_CHECKPOINT_DIR")
        if spec.checkpoint.dir is None and env_dir:  # the service's storage for this job
            spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"dir": env_dir})})
        gpus = torch.cuda.device_count()
        info = dist.detect(os.environ, backend=spec.ddp.backend, gpus=gpus)
        peer = peermode.peer_requested(os.environ)
        remote = _remote(spec.checkpoint.dir)
        if (
            spec.checkpoint.dir is not None and not peer and not remote
        ):  # it belongs to this job, before anything is written there
            _own(Path(spec.checkpoint.dir), spec.name, main=info.is_main)
        events = Events(enabled=info.is_main and not peer, job=spec.name, rank=info.rank)
        if (info.is_main or peer) and spec.checkpoint.dir is not None:  # what `elastrain report` reads
            if remote:
                events.copies.append(_bucket_events(spec.checkpoint.dir))
            else:
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
        from worker.peer.run import run_peer

        return run_peer(built, info, events=events, client=client, forwarder=forwarder, timeout_s=timeout_s)
    trainer: Trainer | None = None
    generation: int | None = None
    try:
        generation = dist.start_group(
            info,
            timeout_s=timeout_s,
            on_timeout=lambda line: die(
                line + "\n", client, line=line, rank=info.rank, step=None, generation=None
            ),
        )
        trainer = _trainer(
            built, info, events=events, client=client, generation=generation, timeout_s=timeout_s
        )
        if info.world_size > 1:
            from worker.start.hangs import Beacon

            trainer.beacon = Beacon(_default_store(), rank=info.rank, world_size=info.world_size)
        trainer.start()
        startgc.release()
        trainer.run()
    except preemption.Preempted:
        preempted(client, trainer)
    except BaseException as exc:
        step = trainer.progress.step if trainer is not None else None
        text, line = _stopped(exc, info, spec.checkpoint.dir, step)
        waited = _waited_for(trainer, events) if "timed out" in str(exc).lower() else None
        if waited:
            text, line = f"{text.rstrip()}\n{waited[0]}\n", f"{line}; {waited[0]}"
        ranks = waited[1] if waited else exc.ranks if isinstance(exc, ReplicaMismatchError) else ()
        again = not isinstance(exc, FinalCheckpointError)
        die(
            text, client, line=line, rank=info.rank, step=step, generation=generation,
            restartable=again, ranks=ranks,
        )  # fmt: skip
    assert trainer is not None
    if client is not None:
        client.close()
    if trainer.metrics is not None:
        trainer.metrics.close()
    del trainer  # the DDP reducer holds the group: release it before the group goes
    dist.shutdown()
    return 0


def _stopped(exc: BaseException, info: DistInfo, run_dir: str | None, step: int | None) -> tuple[str, str]:
    """What a rank that stops on ``exc`` prints, and the line it reports (call it in the
    ``except`` block). A group broken by a lost peer is one line saying who and what happens next
    (the traceback, the transport's and not the run's, goes to the run directory's
    ``worker-errors.log``); our own errors are one line; anything else is its traceback."""
    from worker.recovery.failure import classify
    from worker.report.events import lost_peer_line, torchrun_restarts

    if isinstance(exc, ElastrainError):
        return f"elastrain worker (rank {info.rank}): error: {exc}\n", f"error: {exc}"
    text = traceback.format_exc()
    line = text.strip().splitlines()[-1]
    if info.world_size < 2 or classify(exc).kind != "crash":
        return text, line
    kept = _keep_traceback(run_dir, info.rank, text)
    said = lost_peer_line(
        rank=info.rank, world_size=info.world_size, step=step, error=line,
        restarts=torchrun_restarts(os.environ), checkpoints=run_dir is not None, traceback_at=kept,
    )  # fmt: skip
    return said + "\n", line


def _keep_traceback(run_dir: str | None, rank: int, text: str) -> str | None:
    """Append ``text`` to the run directory's ``worker-errors.log``; its path, None without one."""
    from worker.jobspec.location import is_url

    if run_dir is None or is_url(run_dir):  # a checkpoint location on S3 is no local directory
        return None
    path = Path(run_dir) / "worker-errors.log"
    try:
        with path.open("a", encoding="utf-8") as out:
            out.write(f"--- rank {rank}, pid {os.getpid()}, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n{text}")
    except OSError:
        return None
    return str(path)


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
    from worker.start.hangs import describe

    missing = beacon.missing()
    if not missing:
        return None
    events.record(
        "collective_timeout", step=trainer.progress.step + 1, rank=trainer.info.rank,
        missing_ranks=[a.rank for a in missing],
        last_completed_steps={str(a.rank): a.completed for a in missing},
    )  # fmt: skip
    return f"the collective waited for {describe(missing)}", [a.rank for a in missing]


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
    from worker.train.trainer import Trainer

    spec = built.spec
    job = job_identity(os.environ, spec.name)
    return Trainer(
        built,
        info,
        events=events,
        checkpointer=job_checkpointer(spec, info, events, client, generation, timeout_s),
        generation=generation,
        metrics=WorkerMetrics.from_env(job=job, rank=info.rank, world_size=info.world_size),
    )


def _remote(checkpoint_dir: str | None) -> bool:
    """Whether the checkpoints go to S3; if so, the bucket is checked here, before any rank waits
    on another (a missing bucket, refused credentials, no endpoint: a SpecError naming
    checkpoint.dir)."""
    from worker.jobspec.location import parse_location

    loc = parse_location(checkpoint_dir) if checkpoint_dir else None
    if loc is None:
        return False
    from worker.checkpoint.storage import check_reachable

    check_reachable(loc)
    return True


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


def _bucket_events(checkpoint_dir: str) -> Callable[[str, str], None]:
    """This process's events kept beside its checkpoints in the bucket (``events/``)."""
    import socket

    from worker.checkpoint.storage import storage_for
    from worker.jobspec.location import parse_location
    from worker.report.bucket_events import BucketEvents, events_object

    job = parse_location(checkpoint_dir)
    assert job is not None
    target = events_object(job, time.time(), socket.gethostname(), os.getpid())
    return BucketEvents(target, storage_for(target).write)


def _run_dir(path: str) -> Path:
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SpecError(f"field 'checkpoint.dir': cannot create {path!r}: {exc.strerror}") from None
    return Path(path)


def _service(info: DistInfo, events: Events) -> tuple[ServiceClient | None, EventForwarder | None]:
    """The control plane's client when the service launched us (see worker.report.service_client), and
    the sink that reports this rank's events to it."""
    from worker.report import service_client

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
    from worker.report import service_client

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
