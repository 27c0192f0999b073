"""Who forms the next generation: find the leader, check in, and (on the leader) decide, write
the generation by compare-and-set and tell the members.

* A member of the broken generation tries its candidates in order (the old leader, then the
  members by rank): a refused connection means that candidate is dead, the next is tried; the
  first living one gets this member's check-in and answers ``form`` (the new generation),
  ``fenced``, ``fallback``, ``leave`` or ``not_leader`` (it found a living candidate before it).
  A member that reaches itself in the list leads.
* A newcomer (spare or joiner) connects to the recorded leader and waits to be called. When no
  generation exists yet, or every member of the recorded one is gone, joiners write a
  ``gathering`` record by compare-and-set; the winner leads the first generation (a spare never
  leads: its warmed-up state is not the job's).
* The leader loops over :func:`worker.recovery.plan.decide` until it says form or give up,
  probing silent members (a refused probe is a death), then hosts the store, writes ``gen``
  (losing the write to another leader means following, or being fenced, by the winner's record)
  and sends ``form`` to every member.
* A planned re-formation (joiners waiting) is prepared off the training thread: while joiners
  wait, the leader reads the generation record with its revision and the wished size, and hosts
  the next generation's store, on a thread (:meth:`Resolver.ahead`); it asks the group to
  re-form only once that is done, so the window boundary pays for the compare-and-set and the
  announcement only (the two etcd reads and the store were 7-10 ms of the join's longest
  step here). A recovery after a failure reads afresh (the hosted store is used by whichever
  re-formation comes first).
* A join (a planned re-formation that loses and drops nobody, with a usable read-ahead) is
  announced first and written second: the leader announces the generation, forms the group,
  moves the state, and sends the compare-and-set on a thread (:class:`PendingCommit`,
  :meth:`Resolver.write_pending`) where it waits for the receivers' last chunks and digests
  (the hand-over's final all-gather); it waits for etcd's answer before it gives its part of
  the new generation's first commit vote (:meth:`Resolver.settle`, called by
  ``GroupMember.ballot``). No member applies a window without the leader's part of that vote,
  so no window is applied in a generation that etcd does not hold; a lost compare-and-set
  (another leader wrote ``gen``) or an unknown answer (etcd away) makes the leader raise
  :class:`NotCommitted` instead, and the group re-forms from what etcd holds. Where it is sent
  matters, measured here with per-phase stamps in 1 -> 2 joins: the write's thread holds this
  process's interpreter for 2.5-4 ms of its 5-7 ms, and the training thread waits for it
  whenever it needs the interpreter. Sent before the group formed, it held the formation up (the
  group formed 1-3 ms after the write's answer); sent once the group formed, it held the
  hand-over up by 3-5 ms (the leader's first all-gather came 5.4-7.0 ms after the formation,
  against 1.9-3.3 ms without the thread); sent before the final all-gather, it ends while the
  leader waits 5-10 ms for the receiver there anyway. Two rules keep a generation that was
  announced and never written harmless: the next one is numbered past both the record in etcd
  and the one this member held (:func:`next_generation`), and a record in etcd of the same
  number as the held one but not identical to it is newer (:func:`supersedes`). A
  failure-driven recovery still writes before it announces: its members may hold different
  generations, and its decision is an incident's record. Failpoint: ``before_join_commit`` (on
  the compare-and-set's thread).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.failpoints import failpoint
from worker.recovery.control import ControlError, Link, connect
from worker.recovery.group import StoreHost
from worker.recovery.hub import Hub, message_record, probe
from worker.recovery.membership import KeyValueUnavailable, Membership
from worker.recovery.plan import Fallback, Form, Policy, decide
from worker.recovery.records import Checkin, GenRecord, MemberInfo, RecordError
from worker.recovery.vote import NotCommitted

EventSink = Callable[[str, dict[str, Any]], None]
ANSWERS = ("form", "fenced", "fallback", "leave", "not_leader")
ACK_TIMEOUT_S = 5.0  # a living process's connection thread answers a check-in or a ping at once
PING_AFTER_S = 2.0  # silence on a leader's connection after which it is asked whether it still runs
AHEAD_FRESH_S = 2.0  # a read-ahead older than this is read again before a planned re-formation


@dataclass(frozen=True, slots=True)
class Order:
    """Form ``record``; ``host``: this process hosts its store (the leader); ``link``: the
    connection to the leader (None on the leader)."""

    record: GenRecord
    host: StoreHost | None
    link: Link | None


@dataclass(frozen=True, slots=True)
class Ahead:
    """What the leader read ahead of a planned re-formation (see the module docstring): the
    generation record with its revision, the wished size, and when the read started."""

    current: GenRecord | None
    revision: int
    desired: int | None
    at: float

    def usable(self, old: GenRecord | None, *, now: float) -> bool:
        """Fresh, and read while ``old`` was the current generation. Pure."""
        same = old is not None and self.current is not None and self.current.generation == old.generation
        return same and now - self.at < AHEAD_FRESH_S


class PendingCommit:
    """A join's compare-and-set of ``record``, on a thread that :meth:`start` starts (see the
    module docstring)."""

    def __init__(self, membership: Membership, record: GenRecord, revision: int) -> None:
        self.record = record
        self._failure: str | None = "the group did not form: the compare-and-set was not sent"
        self._thread = threading.Thread(
            target=self._write, args=(membership, revision), name="elastrain-commit", daemon=True
        )

    def start(self) -> None:
        """Send the compare-and-set (once)."""
        if self._thread.ident is None:
            self._failure = "the compare-and-set did not answer"
            self._thread.start()

    def _write(self, membership: Membership, revision: int) -> None:
        try:
            failpoint("before_join_commit")  # raise: etcd's answer lost (tests)
            won = membership.commit_generation(self.record, revision=revision)
        except (KeyValueUnavailable, OSError) as exc:
            self._failure = f"etcd did not answer the compare-and-set ({exc}); it may or may not hold it"
            return
        self._failure = None if won else "another leader wrote the group's generation first"

    def result(self, timeout_s: float) -> str | None:
        """None once the record is in etcd; else why not (or not yet within ``timeout_s``)."""
        if self._thread.ident is None:
            return self._failure
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return f"the compare-and-set did not answer within {timeout_s:.0f} s"
        return self._failure


def supersedes(current: GenRecord | None, held: GenRecord | None) -> bool:
    """Whether etcd's ``current`` record is newer than the generation this member ``held``: a
    higher number, or the same number and not the same record (another leader's, written where
    this member's leader announced one that it never wrote). Pure."""
    if current is None or held is None:
        return False
    return current.generation > held.generation or (current.generation == held.generation and current != held)


def next_generation(current: GenRecord | None, held: GenRecord | None) -> int:
    """The number of the generation to write: past etcd's record and the one this member held
    (which may have been announced and never written). Pure."""
    numbers = [r.generation for r in (current, held) if r is not None]
    return max(numbers, default=-1) + 1


@dataclass(frozen=True, slots=True)
class Refused:
    """No generation for this process: ``kind`` is ``fallback``, ``fenced`` or ``leave``."""

    kind: str
    reason: str


class Resolver:
    def __init__(
        self,
        *,
        me: MemberInfo,
        secret: bytes,
        advertise: str,
        policy: Policy,
        desired_world: int | None,
        store_timeout_s: float,
        hub: Hub,
        membership: Membership,
        on_event: EventSink,
    ) -> None:
        self.me, self.secret, self.advertise, self.policy = me, secret, advertise, policy
        self.desired_world, self.store_timeout_s = desired_world, store_timeout_s
        self.hub, self.membership, self.emit = hub, membership, on_event
        self.decisions: list[dict[str, Any]] = []  # this process's decisions as leader, this incident
        self._ahead: Ahead | None = None
        self._reading: threading.Thread | None = None
        self._host: StoreHost | None = None  # the next generation's store, hosted ahead
        self._pending: PendingCommit | None = None  # a join's compare-and-set, not yet answered

    # -- ahead of a planned re-formation (the leader, while joiners wait) -----------------------
    def ahead(self) -> Ahead | None:
        """The newest read-ahead while it is fresh; else None, and a new one starts on a thread
        (unless one runs). See the module docstring."""
        ahead = self._ahead
        if ahead is not None and time.time() - ahead.at < AHEAD_FRESH_S:
            return ahead
        if self._reading is None or not self._reading.is_alive():
            self._reading = threading.Thread(
                target=self._read_ahead, name="elastrain-read-ahead", daemon=True
            )
            self._reading.start()
        return None

    def _read_ahead(self) -> None:
        started = time.time()
        try:
            if self._host is None:
                self._host = StoreHost(self.advertise, timeout_s=self.store_timeout_s)
            current, revision = self.membership.generation()
        except (KeyValueUnavailable, RecordError, RuntimeError):
            return  # etcd away, or no port for the store: the next ballot asks again
        self._ahead = Ahead(current, revision, self.desired_world_now(), started)

    def _take_ahead(self, old: GenRecord | None, planned: bool) -> Ahead | None:
        ahead, self._ahead = self._ahead, None
        return ahead if planned and ahead is not None and ahead.usable(old, now=time.time()) else None

    def _take_host(self) -> StoreHost:
        host, self._host = self._host, None
        return host if host is not None else StoreHost(self.advertise, timeout_s=self.store_timeout_s)

    def write_pending(self) -> None:
        """Send a join's compare-and-set (the leader, before the hand-over's final all-gather:
        see the module docstring). A no-op without one, and once sent."""
        if self._pending is not None:
            self._pending.start()

    def settle(self) -> None:
        """Wait for a join's compare-and-set (the leader, before its part of the generation's
        first commit vote); raises :class:`NotCommitted` when etcd does not hold the record."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        failure = pending.result(self.store_timeout_s)
        if failure is not None:
            generation = pending.record.generation
            self.emit("generation_not_committed", {"generation": generation, "reason": failure})
            raise NotCommitted(f"generation {generation} was announced, not written: {failure}")

    def close(self) -> None:
        """Stop serving a store hosted ahead and not used. Idempotent."""
        host, self._host = self._host, None
        if host is not None:
            host.close()

    # -- members of the broken generation ------------------------------------------------------
    def reform(
        self, old: GenRecord, link: Link | None, checkin: Checkin, *, planned: bool = False
    ) -> Order | Refused:
        """``planned``: a re-formation the group voted for at a window boundary (joiners
        waiting), which the leader may have read ahead for."""
        dead = set(checkin.dead)
        if link is not None and link.address == old.leader_addr:
            # The old leader's last sign of life is when its connection ended (or its bye), not
            # when this member next ran a collective (a save can hold it for a while): the
            # incident starts there. The hub reads the link again when it times the failure.
            self.hub.lost_link(old.leader, link)
        deadline = checkin.failed_at + self.policy.join_window_s + self.policy.replacement_timeout_s + 30.0
        while time.time() < deadline:
            for member_id, address in old.candidates():
                if member_id in dead:
                    continue
                if member_id == self.me.member_id:
                    return self.lead(old, dead=dead, since=checkin.failed_at, planned=planned)
                try:
                    link = self._link_to(address, link)
                except (OSError, ControlError):  # refused (dead), or unreachable within the timeout
                    dead.add(member_id)
                    continue
                self.hub.follow()
                report = dataclasses.replace(checkin, dead=tuple(sorted(dead)))
                link.send({"t": "checkin", "checkin": report.to_json()})
                answer = _await(link, min(deadline, time.time() + ACK_TIMEOUT_S), (*ANSWERS, "ack"))
                if answer is not None and answer["t"] == "ack":
                    answer = _await(link, deadline)
                if answer is None or answer.get("reason") == TIMEOUT:
                    dead.add(member_id)
                    continue
                if answer["t"] == "not_leader":
                    break
                return _order(answer, link)
            time.sleep(0.05)
        return Refused("fallback", "no leader answered the check-in before the deadline")

    def _link_to(self, address: str, link: Link | None) -> Link:
        if link is not None and link.alive and link.address == address:
            return link
        if link is not None:
            link.close()
        return connect(address, self.secret, me=self.me)

    # -- newcomers -----------------------------------------------------------------------------
    def await_form(self, link: Link | None) -> Order | Refused:
        """Wait to be called into a generation (spares and joiners wait as long as it takes)."""
        while True:
            if link is not None and link.alive:
                answer = _await(link, None)
                if answer is not None and answer["t"] != "not_leader":
                    return _order(answer, link)
                link.close()
                time.sleep(0.1)
            current, revision = self._read()
            link = self._reach(current)
            if link is None and self.me.role == "spare":  # a spare never leads: it waits for members
                time.sleep(0.2)
            elif link is None:
                won = self._gather(current, revision)
                if won is not None:
                    return self.lead(None, dead=set(), since=time.time(), gathering=won)
                time.sleep(0.1)

    def _reach(self, current: GenRecord | None) -> Link | None:
        if current is None:
            return None
        candidates = (
            current.candidates() if current.state == "formed" else [(current.leader, current.leader_addr)]
        )
        for _, address in candidates:
            try:
                return connect(address, self.secret, me=self.me)
            except (OSError, ControlError):
                continue
        return None

    def _gather(self, current: GenRecord | None, revision: int) -> tuple[GenRecord, int] | None:
        """Claim the first generation (nobody leads: no record, or all of its members are gone)."""
        base = current.generation if current is not None and current.state == "formed" else -1
        if current is not None and current.state == "gathering":
            base = current.generation
        record = GenRecord(
            generation=base, members=(), addrs=(), leader=self.me.member_id, leader_addr=self.me.control,
            store="", world_size=0, state="gathering", reason="gathering", formed_at=time.time(),
        )  # fmt: skip
        if not self.membership.commit_generation(record, revision=revision):
            return None
        _, new_revision = self._read()
        return record, new_revision

    # -- the leader ----------------------------------------------------------------------------
    def lead(
        self,
        old: GenRecord | None,
        *,
        dead: set[str],
        since: float,
        gathering: tuple[GenRecord, int] | None = None,
        planned: bool = False,
    ) -> Order | Refused:
        self.hub.lead()
        with contextlib.suppress(NotCommitted):  # a join's write still in flight: let etcd settle first
            self.settle()
        ahead = self._take_ahead(old, planned)
        current: GenRecord | None
        if gathering is not None:
            current, revision = gathering
        elif ahead is not None:
            current, revision = ahead.current, ahead.revision
        else:
            current, revision = self._read()
        if supersedes(current, old):
            assert current is not None
            return self._stale(current)
        decision = self._decide(old, dead, since, ahead)
        if not isinstance(decision, Form):
            return decision
        join = ahead is not None and old is not None and not decision.lost and not decision.leaving
        order = self._commit(decision, old, current, revision, since, background=join)
        if order is None and ahead is not None:  # the read-ahead's revision went stale: read, try once more
            current, revision = self._read()
            if supersedes(current, old):
                assert current is not None
                return self._stale(current)
            order = self._commit(decision, old, current, revision, since)
        if order is None:
            winner, _ = self._read()
            return (
                self._stale(winner) if winner is not None else Refused("fallback", "the generation vanished")
            )
        return order

    def _decide(
        self, old: GenRecord | None, dead: set[str], since: float, ahead: Ahead | None
    ) -> Form | Order | Refused:
        """Decide until the plan says form or give up; probe silent members (a refused probe is a
        death) and re-read the generation (another leader may have formed a newer one) meanwhile."""
        desired = ahead.desired if ahead is not None else self.desired_world_now()
        probed, read = 0.0, time.time()  # probe at the first wait, read etcd after 2 s
        while True:
            now = time.time()
            seen = self.hub.changes  # before the view: a change after it ends the wait below
            view = self.hub.view(old, dead=dead, since=since, desired_world=desired)
            decision = decide(view, self.policy, now)
            if isinstance(decision, Fallback):
                told = set(view.checked_in) | {n.member_id for n in view.newcomers}
                self.hub.tell(told, _fallback(decision.reason))
                return Refused("fallback", decision.reason)
            if isinstance(decision, Form):
                return decision
            if old is not None and now - probed > 0.5:
                probed = now
                found = _probe_silent(old, view.checked_in | view.dead)
                if found - dead:
                    dead |= found
                    continue  # decide again at once
            if old is not None and now - read > 2.0:
                read = now
                current, _ = self._read()
                if supersedes(current, old):
                    assert current is not None
                    return self._stale(current)
            self.hub.wait(min(decision.until, now + 0.5) - now, seen=seen)

    def _commit(
        self, decision: Form, old: GenRecord | None, current: GenRecord | None, revision: int, since: float,
        *, background: bool = False,
    ) -> Order | None:  # fmt: skip
        """Host the store (or take the one hosted ahead), write the generation by compare-and-set,
        tell the members; None when the compare-and-set lost. ``background`` (a join): tell the
        members first and write later, on a thread (see the module docstring); never None."""
        host = self._take_host()
        generation = next_generation(current, old)
        infos = [self._info(m, old) for m in decision.members]
        record = GenRecord(
            generation=generation, members=decision.members, addrs=tuple(i[0] for i in infos),
            leader=self.me.member_id, leader_addr=self.me.control, store=host.address,
            world_size=decision.world_size, reason=decision.reason,
            incident=f"g{old.generation}" if old is not None else "", formed_at=time.time(),
            launch_ids=tuple(i[1] for i in infos),
        )  # fmt: skip
        if background:
            self._pending = PendingCommit(self.membership, record, revision)
        elif not self.membership.commit_generation(record, revision=revision):
            host.close()
            return None
        failed_at = self.hub.failed_at(decision.lost, old, since)  # before announce forgets the check-ins
        detected_at = self.hub.detected_at(old, since)
        missed = self.hub.announce(record, leaving=decision.leaving)
        decided = {
            "generation": generation, "members": list(record.members), "launch_ids": list(record.launch_ids),
            "lost": list(decision.lost), "lost_launch_ids": [self._info(m, old)[1] for m in decision.lost],
            "promoted": list(decision.promoted), "leaving": list(decision.leaving), "reason": decision.reason,
            "world_before": len(old.members) if old is not None else 0, "world_after": decision.world_size,
            "failed_at": failed_at, "detected_at": detected_at, "decided_at": time.time(),
            "unreached": missed,
        }  # fmt: skip
        self.decisions.append(decided)
        self.emit("recovery_decided", decided)
        return Order(record, host, None)

    def _info(self, member_id: str, old: GenRecord | None) -> tuple[str, str]:
        """A member's control address and launch id, from this process, the old record or its hello."""
        if member_id == self.me.member_id:
            return self.me.control, self.me.launch_id
        if old is not None and member_id in old.members:
            index = old.members.index(member_id)
            return old.addrs[index], old.launch_ids[index] if old.launch_ids else ""
        info = self.hub.info_of(member_id)
        return (info.control, info.launch_id) if info is not None else ("", "")

    def _stale(self, current: GenRecord) -> Order | Refused:
        """A newer generation exists: join it if listed (as a late member), else fenced."""
        if self.me.member_id not in current.members:
            return Refused("fenced", f"generation {current.generation} was formed without this member")
        try:
            link = connect(current.leader_addr, self.secret, me=self.me)
        except (OSError, ControlError) as exc:
            return Refused("fallback", f"the leader of generation {current.generation} is unreachable: {exc}")
        late = Checkin(self.me.member_id, current.generation - 1, 0, False, time.time())
        link.send({"t": "checkin", "checkin": late.to_json()})
        answer = _await(link, time.time() + self.store_timeout_s)
        if answer is None or answer["t"] == "not_leader":
            return Refused(
                "fallback", f"the leader of generation {current.generation} did not take this member"
            )
        return _order(answer, link)

    def _read(self) -> tuple[GenRecord | None, int]:
        for _ in range(50):
            try:
                return self.membership.generation()
            except KeyValueUnavailable:
                time.sleep(0.2)
        return self.membership.generation()

    def desired_world_now(self) -> int | None:
        """The service's wished size (etcd ``desired``), else the configured one."""
        try:
            desired = self.membership.desired()
        except (KeyValueUnavailable, RecordError):
            return self.desired_world
        return desired.nodes * self.policy.unit if desired is not None else self.desired_world


def _probe_silent(old: GenRecord, known: frozenset[str]) -> set[str]:
    return {m for m, a in zip(old.members, old.addrs, strict=True) if m not in known and probe(a) is False}


def _fallback(reason: str) -> dict[str, Any]:
    return {"t": "fallback", "reason": reason}


TIMEOUT = "no answer from the leader before the deadline"


def _await(link: Link, deadline: float | None, kinds: tuple[str, ...] = ANSWERS) -> dict[str, Any] | None:
    """The leader's next answer on ``link`` (one of ``kinds``); None when it is gone, or stopped:
    after ``PING_AFTER_S`` of silence it is pinged, and a process that does not answer within
    ``ACK_TIMEOUT_S`` (SIGSTOPped, hung) counts as gone."""
    pinged: float | None = None
    while True:
        now = time.time()
        if deadline is not None and now >= deadline:
            return _fallback(TIMEOUT)
        if pinged is not None and now - pinged >= ACK_TIMEOUT_S:
            link.close()
            return None
        wait = PING_AFTER_S if pinged is None else ACK_TIMEOUT_S - (now - pinged)
        if deadline is not None:
            wait = min(wait, deadline - now)
        try:
            msg = link.recv(max(wait, 0.0))
        except TimeoutError:
            if pinged is None:
                pinged = time.time()
                link.send({"t": "ping"})
            continue
        if msg is None or msg["t"] in kinds:
            return msg
        pinged = None  # any line (a pong) says the leader runs


def _order(answer: dict[str, Any], link: Link) -> Order | Refused:
    kind = answer["t"]
    if kind == "form":
        try:
            return Order(message_record(answer), None, link)
        except RecordError as exc:
            return Refused("fallback", f"the leader sent a bad record: {exc}")
    reason = str(answer.get("reason", kind))
    return Refused(kind if kind in ("fenced", "leave") else "fallback", reason)
