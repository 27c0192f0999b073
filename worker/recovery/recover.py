"""The recovery sequence of one process (docs/recovery.md, "Recovery without a restart: the
workers' side"), and the seam to the trainer.

:class:`GroupMember` is this process's membership in the job's data-parallel group: it joins a
generation (:meth:`~GroupMember.join`, for the first generation, spares and joiners), takes the
commit vote of every window (:meth:`~GroupMember.vote`), and after a failure runs the sequence
(:meth:`~GroupMember.recover`): find the leader, check in, decide, write the generation, form the
group, agree on the newest state, transfer it to whoever lacks it, re-wrap DDP and settle. A
failure during the sequence starts it again with the next generation (one incident, several
attempts); after ``max_attempts`` it gives up (``fallback``: exit and let torchrun restart).

The trainer lends its state through :class:`RecoverableState`. It calls ``recover`` between
windows, outside any ``except`` block, after :meth:`RecoverableState.void_window`; the outcome
says what happened (``peer``: carry on; ``storage``: restore from the checkpoint in process, then
re-wrap and :meth:`~GroupMember.mark_valid`; ``fenced``/``fallback``/``leave``: exit).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from worker.recovery.answers import Order, Refused
from worker.recovery.control import ControlServer, Link
from worker.recovery.failure import Failure, classify, is_incident
from worker.recovery.group import Group, GroupInfo, StoreHost, form, teardown
from worker.recovery.handover import Handed, Holding, hand_over
from worker.recovery.hub import Hub
from worker.recovery.leader import Leader
from worker.recovery.membership import KeyValue, KeyValueUnavailable, Membership
from worker.recovery.records import Checkin, GenRecord, MemberInfo, RecordError
from worker.recovery.resolve import Resolver
from worker.recovery.seam import Outcome, RecoverableState, RecoveryConfig
from worker.recovery.vote import Verdict, check, contribution, reduce_alone, request, stamps_due
from worker.start import lifeline

EventSink = Callable[[str, dict[str, Any]], None]


class GroupMember:
    """This process in the job's group (see the module docstring). ``role``: ``member`` for the
    first generation's processes and fresh replacements (they join), ``spare`` for warm spares."""

    def __init__(
        self,
        cfg: RecoveryConfig,
        *,
        kv: KeyValue,
        role: str = "member",
        launch_id: str = "",
        node_index: int = 0,
        local_rank: int = 0,
        on_event: EventSink | None = None,
        on_record: EventSink | None = None,
    ) -> None:
        """``on_event``: this process's events (the caller may say only rank 0's); ``on_record``:
        the incident this process recorded as the leader, to be said whatever its rank (default:
        ``on_event``)."""
        self.cfg = cfg
        self.emit: EventSink = on_event or (lambda name, fields: None)
        self.emit_record: EventSink = on_record or self.emit
        hello_role = "spare" if role == "spare" else "joiner"
        self.me = MemberInfo(uuid.uuid4().hex, hello_role, "", launch_id, node_index, local_rank, 0)
        self.membership = Membership(kv, cfg.job_id)
        self.hub = Hub(self.me)
        self.server: ControlServer | None = None
        self.resolver: Resolver | None = None
        self.link: Link | None = None
        self.record: GenRecord | None = None
        self.group: Group | None = None
        self.host: StoreHost | None = None
        self.valid = False
        self.last_generation = -1
        self._ballots = (-1, 0)  # (generation, ballots cast in it): when the stamps are due
        self._forget_last_words: Callable[[], None] = lambda: None
        self._unpublished: MemberInfo | None = None  # this member's entry, until publish()

    @property
    def member_id(self) -> str:
        return self.me.member_id

    def start(self) -> None:
        """Listen for members, register in etcd (lease kept alive by a thread)."""
        self.server = ControlServer(
            self.cfg.secret, advertise=self.cfg.advertise,
            on_hello=self.hub.on_hello, on_message=self.hub.on_message, on_close=self.hub.on_close,
        )  # fmt: skip
        self.me = dataclasses.replace(self.me, control=self.server.address, pid=os.getpid())
        self.hub.me = self.me
        self.membership.register(self.me)
        self.resolver = Resolver(
            Leader(
                me=self.me, secret=self.cfg.secret, advertise=self.cfg.advertise, policy=self.cfg.policy,
                desired_world=self.cfg.desired_world, store_timeout_s=self.cfg.collective_timeout_s,
                hub=self.hub, membership=self.membership, on_event=self.emit,
            )
        )  # fmt: skip

    @property
    def info(self) -> GroupInfo:
        record = self.record
        assert record is not None, "not in a generation yet: call join() first"
        rank = record.rank_of(self.member_id)
        assert rank is not None
        return GroupInfo(record.generation, rank, record.world_size, record.members, record.leader,
                         self.cfg.backend, self.cfg.device)  # fmt: skip

    @property
    def is_leader(self) -> bool:
        return self.record is not None and self.record.leader == self.member_id

    def lost_member(self) -> str | None:
        """Why this generation cannot complete a save any more, or None: a member known gone
        (the leader's connection ended; on the leader, a member's; on a member, one the leader
        said it lost). A save waiting for the service stops waiting then; the next collective
        fails and the group re-forms."""
        record = self.record
        if record is None:
            return None
        if self.link is not None and not self.link.alive:
            return f"the group lost its leader ({record.leader[:8]}): the save cannot complete"
        gone = self.hub.gone(record)
        if gone is None and self.link is not None:
            gone = self.link.lost_in(record.generation, record.members)
        return f"the group lost member {gone[:8]}: the save cannot complete" if gone is not None else None

    def publish(self) -> None:
        """Publish this member's entry as the last re-formation left it (etcd ``members/<id>``:
        its role, generation and version). The caller does it after the generation's first step:
        the lease thread's write (a keep-alive and a put, 3-5 ms of this process's interpreter)
        competed with the join's first window for the GIL. Nothing in a re-formation reads those
        fields; the entry itself, and its lease, stand from :meth:`start`."""
        info, self._unpublished = self._unpublished, None
        if info is not None:
            self.membership.update(info)

    def tell_completed(self, step: int) -> None:
        """This member's beacon (:mod:`worker.recovery.beacon`; the beacon's thread): to the
        leader, or, on the leader, to the members."""
        record, link = self.record, self.link
        if record is not None and record.leader == self.member_id:
            self.hub.steps[self.member_id] = step
            self.hub.tell(set(record.members) - {self.member_id}, {"t": "at", "step": step})
        elif link is not None:
            link.send({"t": "at", "step": step})

    def distrust(self) -> None:
        """This member's state may not be handed on: the replicas disagreed (the next re-formation
        restores the newest checkpoint when no member holds a trusted state)."""
        self.valid = False

    def mark_valid(self) -> None:
        """The caller restored its state from storage (after a ``storage`` outcome)."""
        self.valid = True

    # -- the step ------------------------------------------------------------------------------
    def ballot(self, version: int) -> list[float]:
        """This member's part of the window's commit vote (:mod:`worker.recovery.vote`), to be
        summed with the step's own all-reduce; :meth:`verdict` reads the sum. It carries the
        stamps on the generation's first window and every ``STAMPS_EVERY``-th after
        (:func:`~worker.recovery.vote.stamps_due`), counted in this member's ballots of the
        generation: every member casts one a window, or the group breaks. The leader of a join
        first waits for its generation's compare-and-set
        (:meth:`~worker.recovery.leader.Leader.settle`; raises
        :class:`~worker.recovery.vote.NotCommitted` when etcd does not hold it)."""
        record = self.record
        assert record is not None, "not in a generation yet: call join() first"
        self.settle()
        reform = self.is_leader and self._admission_wanted()
        generation, cast = self._ballots
        cast = cast if generation == record.generation else 0
        self._ballots = (record.generation, cast + 1)
        if not stamps_due(cast):
            return request(reform=reform)
        rank = record.rank_of(self.member_id)  # not self.info: no GroupInfo built every window
        assert rank is not None
        return contribution(reform=reform, generation=record.generation, version=version, rank=rank,
                            world_size=record.world_size)  # fmt: skip

    def settle(self) -> None:
        """On the leader of a join: wait for its generation's compare-and-set; raises
        :class:`~worker.recovery.vote.NotCommitted` when etcd does not hold it. A no-op
        otherwise, and once answered."""
        if self.resolver is not None and self.is_leader:
            self.resolver.leader.settle()

    def verdict(self, summed: list[float], *, nonfinite: bool, version: int) -> Verdict:
        """The group's verdict on the window from the summed ballots. Raises
        :class:`~worker.recovery.vote.Fenced`; apply the window only after it returned."""
        assert self.record is not None
        verdict = check(summed, nonfinite=nonfinite, generation=self.record.generation, version=version)
        self.last_generation = self.record.generation
        return verdict

    def vote(self, *, nonfinite: bool, version: int) -> Verdict:
        """The commit vote as its own all-reduce, for a loop without a step reduction to ride on.
        Raises like :meth:`verdict`, or the collective's error when a member is gone."""
        found, summed = reduce_alone(nonfinite=nonfinite, ballot=self.ballot(version), device=self.cfg.device)
        return self.verdict(summed, nonfinite=found, version=version)

    def _admission_wanted(self) -> bool:
        """The leader asks for a re-formation when joiners wait and the group is below target,
        once the re-formation's reads are done ahead
        (:meth:`~worker.recovery.readahead.ReadAhead.ahead`: a window or two later, off this
        thread)."""
        if not self.hub.waiting("joiner") or self.resolver is None:
            return False
        ahead = self.resolver.leader.ahead()
        if ahead is None:
            return False
        assert self.record is not None
        target = self.cfg.policy.fit(ahead.desired or self.cfg.policy.max_world)
        return target > self.record.world_size

    # -- joining and recovering ----------------------------------------------------------------
    def join(self, state: RecoverableState) -> Outcome:
        """Be called into a generation (the first one, or as a spare or a replacement). From then
        on this process's last words are wanted (:meth:`last_words`): its node's loss is an
        incident, timed from its agent's last sign of life. Not before: a spare's loss is none,
        and the lifeline's close looks at the agent cost a standing-by spare 1.6% of a core."""
        outcome = self._reform(state, None)
        if outcome.info is not None:
            self._forget_last_words()
            self._forget_last_words = lifeline.on_last_words(self.last_words)
        return outcome

    def recover(self, state: RecoverableState, failure: Failure) -> Outcome:
        """After a failure (see the module docstring for the caller's part)."""
        generation = self.record.generation if self.record else -1
        fields = {
            "failed_at": failure.at,
            "kind": failure.kind,
            "error": failure.message,
            "generation": generation,
        }
        self.emit("recovery_detected", fields)
        return self._reform(state, failure)

    def _reform(self, state: RecoverableState, failure: Failure | None) -> Outcome:
        since = failure.at if failure is not None else time.time()
        in_window = failure is not None and failure.in_window
        cause = failure  # the retries below replace ``failure``; the incident is the first one's
        old = self.record if self.record is not None and self.member_id in self.record.members else None
        first = old
        if self.resolver is not None:
            self.resolver.leader.decisions = []
        for attempt in range(1, self.cfg.max_attempts + 1):
            order = self._resolve(state, old, since, failure, in_window)
            if isinstance(order, Refused):
                self.valid = self.valid and order.kind == "leave"
                self.emit("recovery_refused", {"kind": order.kind, "reason": order.reason})
                return Outcome(order.kind, reason=order.reason, attempts=attempt)
            fault, handed, phases = self._run(state, order, since, in_window)
            if fault is None:
                outcome = self._outcome(handed, order.record, first, phases, attempt)
                leading = order.record.leader == self.member_id
                if first is not None and cause is not None and leading and is_incident(cause, outcome.lost):
                    self._record_incident(outcome, first)
                return outcome
            self.emit("recovery_retry", {"attempt": attempt, "kind": fault.kind, "error": fault.message})
            if not fault.recoverable:
                return Outcome("fallback", reason=fault.message, attempts=attempt)
            state.void_window()  # outside the except block that caught it: DDP and the group go now
            teardown()
            old, failure = order.record, fault
        return Outcome("fallback", reason=f"the group did not re-form in {self.cfg.max_attempts} attempts")

    def _resolve(
        self,
        state: RecoverableState,
        old: GenRecord | None,
        since: float,
        failure: Failure | None,
        in_window: bool,
    ) -> Order | Refused:
        assert self.resolver is not None, "call start() first"
        try:
            if old is None:
                return self.resolver.await_form(self.link)
            version = state.version() if self.valid else 0
            error = failure.message if failure is not None else ""
            checkin = Checkin(self.member_id, old.generation, version, self.valid, since, error, in_window)
            planned = failure is not None and failure.is_planned
            return self.resolver.reform(old, self.link, checkin, planned=planned)
        except (KeyValueUnavailable, RecordError) as exc:  # etcd away (or a record this worker cannot read)
            return Refused("fallback", f"the group's keys in etcd cannot be used: {exc}")

    def _adopt(self, order: Order) -> None:
        """This process's connection, store and record for the generation being formed."""
        if order.link is not self.link and self.link is not None:
            self.link.close()
        self.link = order.link
        if order.host is not None:
            if self.host is not None:
                self.host.close()
            self.host = order.host
        self.record = order.record
        self.hub.formed(order.record, leading=order.record.leader == self.member_id)

    def _run(
        self, state: RecoverableState, order: Order, since: float, in_window: bool
    ) -> tuple[Failure | None, Handed, dict[str, float]]:
        """Form, hand over, re-wrap. A failure comes back as a value: the caller tears down
        outside this ``except`` block."""
        self._adopt(order)
        phases = {"detected": since}
        info = self.info
        mine = Holding(self.valid, in_window, self.last_generation, self.cfg.spec_hash, state.layout())
        handed = Handed("storage", "not formed")
        try:
            timeout = self.cfg.collective_timeout_s
            self.group = form(info, store_address=order.record.store, timeout_s=timeout, host=order.host)
            phases["formed"] = time.time()
            self.emit("group_formed", {"generation": info.generation, "rank": info.rank,
                                       "world_size": info.world_size, "at": phases["formed"]})  # fmt: skip
            # The leader of a join sends its generation's compare-and-set while it waits for the
            # receivers in the hand-over's last all-gather (worker.recovery.joincommit), or after it.
            write: Callable[[], None] | None = None
            if self.resolver is not None and order.host is not None:
                write = self.resolver.leader.write_pending
            handed = hand_over(state, info, mine, chunk_bytes=self.cfg.chunk_bytes, device=self.cfg.device,
                               emit=self.emit, invalidate=self._invalidate, before_agree=write)  # fmt: skip
            if write is not None:
                write()  # a no-op once sent; a hand-over without a transfer did not send it
            self.valid = handed.kind == "peer"
            phases["transferred"] = time.time()
            if self.valid:
                state.rewrap(info, keep=handed.keep_ddp)
            phases["ready"] = time.time()
        except Exception as exc:
            return classify(exc, in_window=False), handed, phases
        return None, handed, phases

    def _invalidate(self) -> None:
        self.valid = False

    def _outcome(
        self, handed: Handed, record: GenRecord, old: GenRecord | None, phases: dict[str, float], attempt: int
    ) -> Outcome:
        info = self.info
        self.me = dataclasses.replace(self.me, generation=info.generation, version=handed.version)
        self._unpublished = dataclasses.replace(self.me, role="member")
        lost = tuple(m for m in old.members if m not in record.members) if old is not None else ()
        promoted = tuple(m for m in record.members if old is None or m not in old.members)
        return Outcome(
            handed.kind, reason=handed.reason, info=info, source_rank=handed.source,
            bytes_from_peers=handed.bytes, voided_windows=handed.voided, version=handed.version, lost=lost,
            promoted=promoted,
            world_before=len(old.members) if old is not None else 0, attempts=attempt, phases=phases,
        )  # fmt: skip

    def _record_incident(self, outcome: Outcome, first: GenRecord) -> None:
        """The leader writes the incident (etcd ``incidents/g<broken generation>``) off the
        training thread; the service folds it with its own observations."""
        assert self.resolver is not None
        decided = self.resolver.leader.decisions
        incident = f"g{first.generation}"
        record: dict[str, Any] = {
            "incident": incident, "kind": outcome.kind, "reason": outcome.reason,
            "generation": outcome.info.generation if outcome.info else None,
            "lost": list(outcome.lost), "promoted": list(outcome.promoted),
            "lost_launch_ids": sorted({lid for d in decided for lid in d["lost_launch_ids"] if lid}),
            "failed_at": self._failed_at(decided[0]["failed_at"] if decided else None, outcome.lost),
            "detected_at": decided[0]["detected_at"] if decided else None, "source_rank": outcome.source_rank,
            "bytes_from_peers": outcome.bytes_from_peers, "voided_windows": outcome.voided_windows,
            "world_before": outcome.world_before,
            "world_after": outcome.info.world_size if outcome.info else 0,
            "attempts": outcome.attempts, "phases": outcome.phases,
        }  # fmt: skip

        def write() -> None:
            try:
                self.membership.put_incident(incident, record)
            except KeyValueUnavailable as exc:
                self.emit("incident_not_recorded", {"incident": incident, "error": str(exc)[:300]})

        threading.Thread(target=write, name="elastrain-incident", daemon=True).start()
        self.emit_record("recovery_incident", record)

    def _failed_at(self, decided: float | None, lost: tuple[str, ...]) -> float | None:
        """The incident's start: as decided, or earlier when a lost member's last sign of life
        reached this process after the decision (its connection's reader lagged the collective
        that failed first)."""
        known = self.hub.last_sign(lost)
        if decided is None or known is None:
            return decided
        return min(decided, known)

    def last_words(self, when: float) -> None:
        """This process's node died at ``when`` (its torchrun agent, seen by :mod:`worker.start.lifeline`;
        this process stops right after): tell the leader and whoever is connected here, so that the
        incident is timed from then and not from this process's own end."""
        bye = {"t": "bye", "at": when}
        if self.link is not None:
            self.link.send(bye)
        self.hub.tell(None, bye)

    def release_standby(self) -> None:
        """The job is over (the leader calls it): connected spares and joiners are told to leave."""
        if self.is_leader and self.record is not None:
            self.hub.tell(self.hub.standby(self.record), {"t": "leave"})

    def close(self) -> None:
        """Stop listening, drop the lease and the leader connection. Idempotent; the caller
        shuts the process group down itself."""
        self._forget_last_words()
        if self.link is not None:
            self.link.close()
        if self.server is not None:
            self.server.close()
        if self.host is not None:
            self.host.close()
        if self.resolver is not None:
            self.resolver.close()
        self.membership.close()
