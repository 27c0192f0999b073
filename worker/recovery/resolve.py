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
  step here). The compare-and-set still fences: a revision that went stale meanwhile loses it, and
  the leader reads again and tries once more, as it would have. A recovery after a failure reads
  afresh (the hosted store is used by whichever re-formation comes first).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from worker.recovery.control import ControlError, Link, connect
from worker.recovery.group import StoreHost
from worker.recovery.hub import Hub, message_record, probe
from worker.recovery.membership import KeyValueUnavailable, Membership
from worker.recovery.plan import Fallback, Form, Policy, decide
from worker.recovery.records import Checkin, GenRecord, MemberInfo, RecordError

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
        ahead = self._take_ahead(old, planned)
        current: GenRecord | None
        if gathering is not None:
            current, revision = gathering
        elif ahead is not None:
            current, revision = ahead.current, ahead.revision
        else:
            current, revision = self._read()
        if old is not None and current is not None and current.generation > old.generation:
            return self._stale(current)
        decision = self._decide(old, dead, since, ahead)
        if not isinstance(decision, Form):
            return decision
        order = self._commit(decision, old, current, revision, since)
        if order is None and ahead is not None:  # the read-ahead's revision went stale: read, try once more
            current, revision = self._read()
            if old is not None and current is not None and current.generation > old.generation:
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
                if current is not None and current.generation > old.generation:
                    return self._stale(current)
            self.hub.wait(min(decision.until, now + 0.5) - now, seen=seen)

    def _commit(
        self, decision: Form, old: GenRecord | None, current: GenRecord | None, revision: int, since: float
    ) -> Order | None:
        """Host the store (or take the one hosted ahead), write the generation by compare-and-set,
        tell the members; None when the compare-and-set lost."""
        host = self._take_host()
        generation = (current.generation if current is not None else -1) + 1
        infos = [self._info(m, old) for m in decision.members]
        record = GenRecord(
            generation=generation, members=decision.members, addrs=tuple(i[0] for i in infos),
            leader=self.me.member_id, leader_addr=self.me.control, store=host.address,
            world_size=decision.world_size, reason=decision.reason,
            incident=f"g{old.generation}" if old is not None else "", formed_at=time.time(),
            launch_ids=tuple(i[1] for i in infos),
        )  # fmt: skip
        if not self.membership.commit_generation(record, revision=revision):
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
