"""The worker's entry point: validate everything that can be validated, then train.

Bad input (spec, options, batch that cannot be split) is one line on stderr and exit code 2,
before any process group starts. Under torchrun every rank runs this; outside it, one process.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from worker.errors import ElastrainError, SpecError

if TYPE_CHECKING:
    from worker.checkpoint import Checkpointer
    from worker.dist import DistInfo
    from worker.events import Events
    from worker.service_client import ServiceClient
    from worker.spec import JobSpec

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
    import torch

    from worker import dist
    from worker.events import Events
    from worker.spec import load_spec
    from worker.trainer import Trainer

    try:
        spec = load_spec(args.config)
        env_dir = os.environ.get("ELASTRAIN_CHECKPOINT_DIR")
        if spec.checkpoint.dir is None and env_dir:  # the service's storage for this job
            spec = spec.model_copy(update={"checkpoint": spec.checkpoint.model_copy(update={"dir": env_dir})})
        info = dist.detect(os.environ, backend=spec.ddp.backend, cuda_available=torch.cuda.is_available())
        events = Events(enabled=info.is_main, job=spec.name, rank=info.rank)
        if info.is_main and spec.checkpoint.dir is not None:  # the run dir `elastrain report` reads
            events.log_path = _run_dir(spec.checkpoint.dir) / "events.jsonl"
        timeout_s = _collective_timeout(os.environ.get("ELASTRAIN_COLLECTIVE_TIMEOUT_S", "300"))
        trainer = Trainer(
            spec, info, events=events, resuming=_resuming(spec.checkpoint.dir, spec.checkpoint.resume)
        )
    except SpecError as exc:
        print(f"elastrain worker: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    client = _service(info, events)
    try:
        trainer.generation = dist.start_group(
            info, timeout_s=timeout_s, on_timeout=lambda line: _die(line + "\n", client)
        )
        trainer.checkpointer = _checkpointer(spec, info, events, client, trainer.generation, timeout_s)
        trainer.start()
        trainer.run()
    except ElastrainError as exc:
        _die(f"elastrain worker (rank {info.rank}): error: {exc}\n", client)
    except BaseException:
        _die(traceback.format_exc(), client)
    if client is not None:
        client.close()
    if trainer.metrics is not None:
        trainer.metrics.close()
    del trainer  # the DDP reducer holds the group: release it before the group goes
    dist.shutdown()
    return 0


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


def _service(info: DistInfo, events: Events) -> ServiceClient | None:
    """The control plane's client when the service launched us (see worker.service_client)."""
    from worker import service_client

    client = service_client.from_env()
    if client is not None:
        client.heartbeat_from(info.local_rank)
        events.sinks.append(
            service_client.forward_events(client, rank=info.rank, world_size=info.world_size, env=os.environ)
        )
    return client


def _die(message: str, client: ServiceClient | None) -> NoReturn:
    """Exit 1 at once: a normal interpreter exit can hang in gloo's teardown (see dist.shutdown)."""
    if client is not None:
        client.event("failed", message=message.strip().splitlines()[-1][:2000])
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
) -> Checkpointer | None:
    """The job's checkpointer (the service coordinates publishing when it launched us), or None
    when the spec has no checkpoint directory. Its waits for the other ranks (the restore
    agreement, a save's reports) end after the collective timeout, like a collective's."""
    if spec.checkpoint.dir is None:
        return None
    from worker.checkpoint import Checkpointer
    from worker.service_client import HttpCoordinator
    from worker.setup import spec_hash

    return Checkpointer(
        spec.checkpoint,
        job=os.environ.get("ELASTRAIN_JOB_ID", spec.name),
        spec_hash=spec_hash(spec),
        data_version=spec.data.version,
        rank=info.rank,
        world_size=info.world_size,
        generation=generation,
        parallelism=spec.parallelism,
        seed=spec.seed,
        run_record={},
        coordinator=HttpCoordinator(client) if client is not None else None,
        timeout_s=timeout_s,
        on_event=lambda name, fields: events.emit(name, **fields),
    )
