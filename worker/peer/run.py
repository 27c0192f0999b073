"""The worker's run in peer mode (``ELASTRAIN_RECOVERY=peer``): build the trainer on a
private world of one, join the job's group as a member (or stand by as a spare until promoted),
train through every recovery (:mod:`worker.peer.loop`), and exit so that the node's torchrun agent and
the service read the right thing: 0 when training finished or the group let this process go, 1
(the agent respawns it as a newcomer) when it failed or the group could not re-form.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from typing import TYPE_CHECKING

from worker.errors import ElastrainError, FinalCheckpointError
from worker.start import startgc
from worker.train.preemption import Preempted
from worker.wiring import die, job_checkpointer, preempted

if TYPE_CHECKING:
    from worker.checkpoint import Checkpointer
    from worker.recovery.recover import GroupMember
    from worker.report.events import Events
    from worker.report.service_client import EventForwarder, ServiceClient
    from worker.start.build import Built
    from worker.start.dist import DistInfo


def run_peer(
    built: Built,
    info: DistInfo,
    *,
    events: Events,
    client: ServiceClient | None,
    forwarder: EventForwarder | None,
    timeout_s: float,
) -> int:
    from worker.checkpoint.owner import job_identity
    from worker.metrics import WorkerMetrics
    from worker.peer import member as peermode
    from worker.peer.loop import PeerExit, PeerLoop
    from worker.recovery.group import teardown
    from worker.start.parts import Wrapped, spec_hash
    from worker.train.trainer import Trainer

    spec = built.spec
    if forwarder is not None:
        forwarder.rank = -1  # nothing is reported before this process holds a rank of the group
    role = peermode.role(os.environ)
    cfg = peermode.config(spec, info, os.environ, spec_hash=spec_hash(spec), timeout_s=timeout_s)

    def on_event(name: str, fields: dict[str, object]) -> None:
        events.emit(name, **fields)

    def on_record(name: str, fields: dict[str, object]) -> None:
        events.record(name, **fields)

    def checkpointer(
        seat: DistInfo, generation: int, on_thread: bool, after: Checkpointer | None
    ) -> Checkpointer | None:
        lost = member.lost_member if member is not None else None
        return job_checkpointer(
            spec, seat, events, client, generation, timeout_s, abandon=lost, open_on_thread=on_thread,
            after=after,
        )  # fmt: skip

    trainer: Trainer | None = None
    member = None
    try:
        peermode.private_group(info, timeout_s=timeout_s)
        job = job_identity(os.environ, spec.name)
        trainer = Trainer(
            built, info, events=events, checkpointer=None, generation=0,
            metrics=WorkerMetrics.from_env(job=job, rank=info.rank, world_size=info.world_size),
        )  # fmt: skip
        member = peermode.member(cfg, info, os.environ, on_event=on_event, on_record=on_record)
        loop = PeerLoop(trainer, member, checkpointer=checkpointer, forwarder=forwarder, job_id=cfg.job_id)
        startgc.release()  # built, and standing ready: what start-up made lives on (worker/start/startgc.py)
        if role == "spare":
            events.record("spare_standby", member_id=member.member_id, control=member.me.control)
        joined = threading.Event()
        threading.Thread(
            target=_leave_when_finished, args=(member, joined, events), name="elastrain-finished", daemon=True
        ).start()
        loop.join()
        joined.set()
        loop.run()
    except Preempted:  # the group stopped on request and saved
        if member is not None:
            with contextlib.suppress(ElastrainError):
                member.close()
        preempted(client, trainer)
    except PeerExit as exc:  # not a failure of the job: nothing to report
        events.emit("peer_left", reason=str(exc))
        if exc.code != 0:
            _fail(exc, None, trainer, info)
    except BaseException as exc:
        _fail(exc, client, trainer, info)
    assert trainer is not None
    if client is not None:
        client.close()
    if trainer.metrics is not None:
        trainer.metrics.close()
    trainer.wrapped = Wrapped(trainer.model, fsdp=False)  # the DDP reducer holds the group
    teardown()
    if member is not None:
        member.close()
    return 0


def _leave_when_finished(member: GroupMember, joined: threading.Event, events: Events) -> None:
    """A worker still waiting to be called into the group when training finished (a spare, a
    replacement or a node added near the end) leaves: exit 0, its node app ends as SUCCEEDED."""
    key = member.membership.keys.finished
    while not joined.wait(1.0):
        try:
            done = member.membership.kv.get(key) is not None
        except ElastrainError:
            continue
        if done and not joined.is_set():
            events.emit("peer_left", reason="training finished before this worker was called into the group")
            os._exit(0)


def _fail(exc: BaseException, client: ServiceClient | None, trainer: object, info: DistInfo) -> None:
    text = f"elastrain worker (peer, local rank {info.local_rank}): error: {exc}\n"
    line = f"error: {exc}"
    if not isinstance(exc, ElastrainError):
        text = traceback.format_exc()
        line = text.strip().splitlines()[-1]
    progress = getattr(trainer, "progress", None)
    step = progress.step if progress is not None else None
    generation = getattr(trainer, "generation", None)
    rank = getattr(getattr(trainer, "info", info), "rank", info.rank)
    again = not isinstance(exc, FinalCheckpointError)
    die(text, client, line=line, rank=rank, step=step, generation=generation, restartable=again)
