"""Peer mode: the training loop of one process in the job's data-parallel group (see
docs/recovery.md, "Recovery without a restart: the workers' side"), the :class:`worker.train.trainer.Trainer`
driven by :mod:`worker.recovery`.

Every window: the random streams are derived from ``(seed, version, rank)``, the trainer's step
runs, and its commit point is the group's vote (:meth:`GroupMember.ballot` rides on the step's
all-reduce, :meth:`GroupMember.verdict` decides before any state changes). A failure raised
anywhere in the window (a failed or timed-out collective, a vote that fenced this member) is
classified *inside* the ``except`` block and handled *outside* it: the window is voided
(gradients dropped, the DDP wrapper let go), the group torn down, the recovery run
(:meth:`GroupMember.recover`), and the trainer re-seated on the new generation (rank, world
size, batch plan, checkpointer, feed, the rank-0 reporter). A planned re-formation (joiners
waiting) takes the same path at a window boundary.

The service hears of each incident from the recovery's leader (the peer contract; the leader
decided and timed it, and is not always rank 0: a replacement takes the lost rank, rank 0
included): ``recovery`` ``started`` once the group formed and holds the agreed state, ``done``
at its first committed step, and ``spare_promoted`` for a spare that took a lost member's slot.
The leader writes them to the run's event log whatever its rank (:meth:`Events.record`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from worker.checkpoint import Checkpointer
from worker.datapath.feed import Feed, make_feed
from worker.errors import ElastrainError, ReplicaMismatchError
from worker.recovery.beacon import ControlStore, last_completed
from worker.recovery.failure import Failure, classify, is_incident
from worker.recovery.group import GroupInfo, teardown
from worker.recovery.records import GenRecord
from worker.recovery.recover import GroupMember, Outcome
from worker.recovery.rewrap import carry_over, layout_digest, prepare, rewrap
from worker.recovery.rng import derive_window_rng
from worker.recovery.vote import NotCommitted
from worker.report.service_client import EventForwarder
from worker.start.dist import DistInfo
from worker.start.hangs import Beacon
from worker.start.parts import Wrapped
from worker.train import preemption
from worker.train.integrity import replica_check
from worker.train.objective import call_model
from worker.train.preemption import Preempted
from worker.train.progress import Progress
from worker.train.schedule import plan_batch
from worker.train.trainer import Trainer

CheckpointerFactory = Callable[[DistInfo, int, bool, Checkpointer | None], Checkpointer | None]
"""(this generation's seat, its number, whether to open it on a thread, the checkpointer whose save
in flight it waits for before its opening: see Checkpointer)"""


class PeerExit(ElastrainError):
    """The group went on without this process, or gave up re-forming: exit with ``code``
    (0: a planned leave; 1: torchrun respawns this node's workers as newcomers)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class PeerState:
    """:class:`worker.recovery.seam.RecoverableState` over a :class:`Trainer`."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        x, y = trainer.data.batch(np.zeros(1, dtype=np.int64))
        self._probe = (x.to(trainer.device), y.to(trainer.device))

    @property
    def model(self) -> torch.nn.Module:
        return self.trainer.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    def version(self) -> int:
        """Committed windows: steps plus skipped fp16 windows."""
        return self.trainer.progress.step + self.trainer.scaler.state.skipped_total

    def progress(self) -> dict[str, Any]:
        """Less the batch plan: each member plans its own for the new world size (a spare built
        it for a world of one)."""
        t = self.trainer
        blob = t.progress.to_json(t.scaler, t.monitor, t.plan)
        del blob["batch_plan"]
        return blob

    def load_progress(self, blob: dict[str, Any]) -> None:
        t = self.trainer
        t.progress = Progress.from_json(blob)
        t.scaler.load_state_dict(blob["loss_scaler"])
        t.monitor.load_state_dict(blob["monitor"])

    def void_window(self, *, keep_ddp: bool = False) -> None:
        """``keep_ddp``: a planned re-formation at a window boundary (nothing in flight): the
        settled DDP wrapper stays, for :meth:`rewrap` to carry over if every member can."""
        t = self.trainer
        t.optimizer.zero_grad(set_to_none=True)
        if not keep_ddp:
            t.wrapped = Wrapped(t.model, fsdp=False)  # no reference to DDP or its group
        if t.recorder is not None:  # the sample trace: what the voided window loaded was not trained
            t.recorder.take()

    def _ddp(self) -> DistributedDataParallel | None:
        module = self.trainer.wrapped.module
        return module if isinstance(module, DistributedDataParallel) else None

    def _forward(self, module: torch.nn.Module) -> torch.Tensor:
        x, y = self._probe
        return self.trainer.objective.loss_sum(call_model(module, x), y)

    def prepare(self) -> None:
        """A newcomer, in its private world of one: settle the DDP wrapper the trainer built, so
        that a planned join can carry it over (:func:`worker.recovery.rewrap.prepare`)."""
        ddp = self._ddp()
        if ddp is not None:
            prepare(ddp, self._forward)

    def layout(self) -> bytes:
        return layout_digest(self._ddp())

    def rewrap(self, info: GroupInfo, *, agreed: bool = True, keep: bool = False) -> None:
        """``agreed``: see :func:`worker.recovery.rewrap.rewrap` (False after a restore); ``keep``:
        carry the held DDP over (:func:`worker.recovery.rewrap.carry_over`)."""
        t = self.trainer
        t.info = info.dist_info(t.info)
        held = self._ddp()
        if keep and held is not None:
            carry_over(held)
            return
        del held
        t.wrapped = Wrapped(t.model, fsdp=False)  # a wrapper still held must not hook the new one's backward
        cap = t.spec.ddp.bucket_cap_mb
        ddp = rewrap(t.model, t.info, bucket_cap_mb=cap, forward=self._forward, agreed=agreed)
        t.wrapped = Wrapped(ddp, fsdp=False)
        if t.metrics is not None and t.spec.monitor.time_communication:
            ddp.register_comm_hook(None, t.metrics.comm.hook)


def keeps_save_in_flight(outcome: Outcome, failure: Failure | None) -> bool:
    """Whether the new generation's checkpointer waits for the old one's save in flight (an
    async save still writing, or awaiting its publication) before it opens (Checkpointer
    ``after``): after a join -- a planned re-formation at a window boundary that formed at its
    first attempt, lost no member and had a ``peer`` outcome. Every member of the old group is
    in the new one then, alive to complete that save, and it is kept: the new rank 0's orphan
    scan would otherwise remove its staging directory under its writers, and a scale-up would
    lose a checkpoint. Not when a member was lost or left: that save cannot complete without
    it, and waiting for its end would hold the new generation's first save. Pure."""
    planned = failure is not None and failure.is_planned
    return planned and outcome.kind == "peer" and outcome.attempts == 1 and not outcome.lost


def merge_slots(known: dict[str, int], found: dict[str, int]) -> dict[str, int]:
    """Member id -> node slot after a read of etcd's ``members/``: a slot already known wins.
    A promoted spare's etcd entry keeps the index it was started with; its slot is the lost
    node's it filled (set at the promotion), which a later read must not undo. Pure."""
    return found | known


class PeerLoop:
    """The trainer in the group (see the module docstring). ``checkpointer(info, generation)``
    builds the checkpointer of a generation; ``forwarder`` is the service reporter (None without
    the service)."""

    def __init__(
        self,
        trainer: Trainer,
        member: GroupMember,
        *,
        checkpointer: CheckpointerFactory,
        forwarder: EventForwarder | None,
        job_id: str,
    ) -> None:
        self.trainer, self.member = trainer, member
        self.state = PeerState(trainer)
        self.make_checkpointer, self.forwarder, self.job_id = checkpointer, forwarder, job_id
        self.reform = False
        self.started = False
        self.slots: dict[str, int] = {}  # member id -> node index, for spare_promoted
        self._slots_lock = threading.Lock()  # the read after a first step runs on a thread
        self.pending: dict[str, Any] | None = None  # the recovery report awaiting its first step
        self.disagreeing: tuple[int, ...] = ()  # the ranks a replica mismatch named (its incident's)
        trainer.commit = self
        trainer.window_rng = self._derive
        trainer.replicas = None  # each generation's own check, built when it is seated
        trainer.on_first_step = self._first_step
        # stragglers.action replace: the leader counts the warm spares waiting, on the window's ballot
        trainer.stragglers.spares = self._spares_waiting
        trainer.stragglers.min_world = member.cfg.policy.min_world
        trainer.beacon = Beacon(ControlStore(member), rank=trainer.info.rank, world_size=1)

    # -- the step ------------------------------------------------------------------------------
    def ballot(self) -> list[float]:
        """The commit vote's part of the step's all-reduce (worker.train.step.Commit)."""
        return self.member.ballot(self.state.version())

    def decide(self, found: bool, summed: Sequence[float]) -> bool:
        verdict = self.member.verdict(list(summed), nonfinite=found, version=self.state.version())
        self.reform = verdict.reform
        return verdict.nonfinite

    def _spares_waiting(self) -> int:
        """Warm spares connected to this member, counted by the group's leader (0 elsewhere)."""
        return self.member.hub.waiting("spare") if self.member.is_leader else 0

    def _derive(self) -> None:
        derive_window_rng(self.trainer.spec.seed, self.state.version(), self.trainer.info.rank)

    # -- the loop ------------------------------------------------------------------------------
    def join(self) -> None:
        """Be called into a generation (a spare waits until promoted) and take its state. The
        trainer was built in a private world of one: its DDP is settled there first, then that
        world ends."""
        self.state.prepare()
        teardown()
        with preemption.REQUEST.leaving_at_once():
            outcome = self.member.join(self.state)
        self._settle(outcome, None, None)

    def run(self) -> dict[str, Any]:
        """Train to ``max_steps`` through every recovery; returns the finished event's fields."""
        trainer = self.trainer
        while True:
            failure = self._train() or self._settled()
            if failure is None:
                break
            if not failure.recoverable:
                raise ElastrainError(f"this rank failed ({failure.message}); torchrun starts it again")
            old, reached = self.member.record, trainer.progress.step  # the step it had committed
            if failure.kind == "mismatch":  # nobody's state is trusted: the newest checkpoint is
                self.member.distrust()
            # outside the except block: DDP, its group and sockets go now (a planned re-formation
            # keeps the settled DDP: nothing is in flight, and every member may carry it over)
            with preemption.REQUEST.leaving_at_once():
                self.state.void_window(keep_ddp=failure.is_planned)
                teardown()
                outcome = self.member.recover(self.state, failure)
            self._settle(outcome, old, failure, reached=reached)
        fields = trainer._finish()
        if trainer.info.rank == 0:  # a worker still waiting to join (it came late) leaves: see peerrun
            with contextlib.suppress(ElastrainError):
                kv = self.member.membership.kv
                kv.put(self.member.membership.keys.finished, json.dumps({"step": fields["step"]}).encode())
        self.member.release_standby()
        if trainer.beacon is not None:
            trainer.beacon.close()
        return fields

    def _train(self) -> Failure | None:
        trainer = self.trainer
        feed = self._feed()
        start = self.state.version()
        failure: Failure | None = None
        self.disagreeing = ()
        try:
            while trainer.progress.step < trainer.spec.max_steps:
                trainer.window(feed)
                start = self.state.version()
                if self.reform:
                    self.reform = False
                    failure = Failure.planned()
                    break
        except Preempted:  # the whole group stopped on request and saved: not a failure
            raise
        except Exception as exc:
            failure = classify(exc, in_window=self.state.version() == start)
            self.disagreeing = exc.ranks if isinstance(exc, ReplicaMismatchError) else ()
        finally:
            feed.close()
        return failure

    def _settled(self) -> Failure | None:
        """The last window asked for a join, so the loop ends without a vote in the joined
        generation: its leader still waits for that generation's compare-and-set before the
        run's end (its final save) is done in it. A failure when etcd does not hold it."""
        try:
            self.member.settle()
        except NotCommitted as exc:
            return classify(exc, in_window=False)
        return None

    def _feed(self) -> Feed:
        t = self.trainer
        return make_feed(
            t.data, depth=t.prefetch, seed=t.spec.seed, rank=t.info.rank, world_size=t.info.world_size,
            micro_batch=t.plan.micro_batch, accum_steps=t.plan.accum_steps, device=t.device,
        )  # fmt: skip

    # -- after a join or a recovery ------------------------------------------------------------
    def _settle(
        self, outcome: Outcome, old: GenRecord | None, failure: Failure | None, *, reached: int | None = None
    ) -> None:
        """Take the new generation (see :meth:`_seat`), its state (a restore from storage when
        no member holds it), and, the recovery's leader, report the incident; ``reached``: the
        step this member had committed when the group failed (the incident's ``step_before``)."""
        self.trainer.events.emit("peer_outcome", **_describe(outcome))
        if outcome.kind not in ("peer", "storage") or outcome.info is None:
            code = 0 if outcome.kind == "leave" else 1
            raise PeerExit(f"peer recovery: {outcome.kind}: {outcome.reason}", code)
        info = outcome.info
        self._seat(info, peer=outcome.kind == "peer", keep_save=keeps_save_in_flight(outcome, failure))
        read = 0
        if outcome.kind == "storage":
            read = self._restore(info)
        if failure is not None and old is not None and is_incident(failure, outcome.lost):
            self._report_started(outcome, old, failure, read, reached)

    def _seat(self, info: GroupInfo, *, peer: bool, keep_save: bool = False) -> None:
        """Rank, world size, batch plan, checkpointer and reporter of the new generation. After a
        ``peer`` outcome the checkpointer opens on a thread started after the generation's first
        step, or by a save before it (the job's directory was claimed when the group's state
        first came from storage or the seed; nothing reads it before a save);
        a ``storage`` outcome restores through it at once. ``keep_save``: the old generation's
        save in flight is completed before the new checkpointer's opening (see
        :func:`keeps_save_in_flight`)."""
        t = self.trainer
        t.info = info.dist_info(t.info)
        t.generation = info.generation
        t.events.rank, t.events.enabled = info.rank, info.rank == 0
        if self.forwarder is not None:
            self.forwarder.rank, self.forwarder.world_size = info.rank, info.world_size
        plan = plan_batch(t.spec, info.world_size, reference_batch=t.progress.reference_batch, resuming=True)
        if plan != t.plan and self.started:
            t.events.emit("batch_replanned", world_size=info.world_size, batch_plan=plan.to_json())
        t.plan = plan
        if t.metrics is not None:
            t.metrics.reseat(rank=info.rank, world_size=info.world_size)
        previous = t.checkpointer if keep_save else None
        t.checkpointer = self.make_checkpointer(t.info, info.generation, peer, previous)
        if t.checkpointer is not None:
            t.checkpointer.run_record = t.record
        t.stepped = False
        t.replicas = replica_check(
            t.spec, t.model, t.optimizer, t.info, events=t.events, metrics=t.metrics, notes=[], defer=False
        )  # fmt: skip

    def _restore(self, info: GroupInfo) -> int:
        """No member holds a usable state: the checkpoint (or the seed, for a new job). After a
        replica mismatch with no checkpoint published yet, this process exits (:class:`PeerExit`
        1): its torchrun agent starts it again, and the new group starts from the seed."""
        t = self.trainer
        before = t.checkpointer.stats.bytes_read_total if t.checkpointer is not None else 0
        if not self.started:
            t.start()  # the first generation: resume if a checkpoint says so, write the run record
            self.started = True
        elif not t._resume() and self.disagreeing:
            # nothing published yet, and every state in memory took the corrupt replica's gradients
            raise PeerExit("the replicas disagreed before a checkpoint was published: start from the seed", 1)
        self.state.rewrap(info, agreed=False)
        self.member.mark_valid()
        return (t.checkpointer.stats.bytes_read_total if t.checkpointer is not None else 0) - before

    def _remember_slots(self) -> None:
        """Every member's node index (etcd ``members/``), read by every member once per
        generation, on a thread after its first step (3-10 ms of etcd that were in the first
        windows after a join): whichever member survives the next loss may lead its recovery and
        report it. Read again when a lost member's slot is unknown (it was lost before its
        generation's first step: its entry outlives it by its lease). A lost member's slot is what
        a promoted spare fills."""
        with contextlib.suppress(ElastrainError, ValueError):  # etcd away, or a record it cannot read
            found = {m: i.node_index for m, i in self.member.membership.members().items()}
            with self._slots_lock:
                self.slots = merge_slots(self.slots, found)

    def _report_started(
        self, outcome: Outcome, old: GenRecord, failure: Failure, read: int, reached: int | None
    ) -> None:
        info = outcome.info
        assert info is not None
        if not self.member.is_leader:
            return
        decided = self.member.resolver.leader.decisions if self.member.resolver is not None else []
        named = [old.members.index(m) for m in outcome.lost if m in old.members]
        launches = [old.launch_ids[r] for r in named if r < len(old.launch_ids) and old.launch_ids[r]]
        lost_ranks = named or list(self.disagreeing)  # a replica mismatch loses no member: its ranks
        phases = outcome.phases
        failed_at = decided[0].get("failed_at") if decided else None
        trained = self.member.member_id in old.members
        report: dict[str, Any] = {
            "incident": f"{self.job_id}/g{old.generation}", "recovery_kind": outcome.kind,
            "lost": launches[:64], "lost_ranks": lost_ranks[:1024],
            "failed_at": failed_at if failed_at is not None else failure.at,
            "detected_at": phases.get("detected", failure.at), "formed_at": phases.get("formed"),
            "transferred_at": phases.get("transferred"), "source_rank": outcome.source_rank,
            "bytes_from_peers": outcome.bytes_from_peers, "bytes_from_storage": max(read, 0),
            "voided_windows": outcome.voided_windows, "world_before": max(len(old.members), 1),
            "world_after": info.world_size, "step": self.trainer.progress.step, "rank": info.rank,
            "step_before": step_before(reached, self.trainer.progress.step, trained),
            "last_completed_steps": last_completed(old.members, outcome.lost, self.member.hub.steps),
        }  # fmt: skip
        self.trainer.events.record("recovery", phase="started", **report)
        self.pending = report
        self._report_promoted(outcome, old, info)

    def _report_promoted(self, outcome: Outcome, old: GenRecord, info: GroupInfo) -> None:
        record = self.member.record
        assert record is not None
        lost = [m for m in old.members if m in outcome.lost]
        fresh = [m for m in record.members if m not in old.members]
        with self._slots_lock:
            unknown = any(gone not in self.slots for gone in lost)
        if unknown:
            self._remember_slots()
        for spare, gone in zip(fresh, lost, strict=False):
            slot = self.slots.get(gone)
            rank = record.members.index(spare)
            launch = record.launch_ids[rank] if rank < len(record.launch_ids) else ""
            if launch and launch in old.launch_ids:  # the lost node's own agent respawned it: no spare
                continue
            if slot is None or not launch:
                self.trainer.events.record("spare_slot_unknown", member=spare, lost=gone)
                continue
            self.trainer.events.record("spare_promoted", launch_id=launch, node_index=slot, rank=rank)
            with self._slots_lock:
                self.slots[spare] = slot

    def _first_step(self) -> None:
        if self.trainer.checkpointer is not None:  # a peer outcome's opening, off the first window
            self.trainer.checkpointer.start_opening()
        self.member.publish()  # this member's etcd entry, off the join's first window
        report, self.pending = self.pending, None
        if report is not None:  # the leader's (see _report_started)
            self.trainer.events.record(
                "recovery", **(report | {"phase": "done", "first_step_at": time.time()})
            )
        # the generation's slots, read after its first step on a thread: not on a join's or a
        # recovery's path (3-10 ms of etcd in the first windows after a join here)
        threading.Thread(target=self._remember_slots, name="elastrain-slots", daemon=True).start()


def step_before(reached: int | None, resumed: int, trained_in_old: bool) -> int | None:
    """The step the failed group had reached, as the recovery's leader counts it: the step it
    had committed, if it trained in that group (a spare or newcomer did not: None, the service
    keeps its own count), never below the step resumed from. Pure."""
    if reached is None or not trained_in_old:
        return None
    return max(reached, resumed)


def _describe(outcome: Outcome) -> dict[str, Any]:
    info = outcome.info
    return {
        "kind": outcome.kind, "reason": outcome.reason, "source_rank": outcome.source_rank,
        "bytes_from_peers": outcome.bytes_from_peers, "voided_windows": outcome.voided_windows,
        "version": outcome.version, "lost": list(outcome.lost), "promoted": list(outcome.promoted),
        "attempts": outcome.attempts, "phases": outcome.phases,
        "generation": info.generation if info else None, "rank": info.rank if info else None,
        "world_size": info.world_size if info else None,
    }  # fmt: skip
