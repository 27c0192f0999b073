"""The leader's side of a re-formation: decide who forms the next generation, write it by
compare-and-set and tell the members.

The leader loops over :func:`worker.recovery.plan.decide` until it says form or give up,
probing silent members (a refused probe is a death), then hosts the store, writes ``gen``
(losing the write to another leader means following, or being fenced, by the winner's record)
and sends ``form`` to every member. A planned re-formation uses what was read ahead
(:mod:`worker.recovery.readahead`); a join announces first and writes second
(:mod:`worker.recovery.joincommit`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from worker.recovery.answers import Order, Refused, await_answer, fallback, order_from
from worker.recovery.control import ControlError, connect
from worker.recovery.hub import Hub, probe
from worker.recovery.joincommit import PendingCommit, announced_first, next_generation, supersedes
from worker.recovery.membership import KeyValueUnavailable, Membership
from worker.recovery.plan import Fallback, Form, Policy, decide
from worker.recovery.readahead import Ahead, ReadAhead
from worker.recovery.records import Checkin, GenRecord, MemberInfo, RecordError
from worker.recovery.vote import NotCommitted

EventSink = Callable[[str, dict[str, Any]], None]


class Leader:
    """This process as the leader of a re-formation (any member may become one)."""

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
        self.me, self.secret, self.policy = me, secret, policy
        self.desired_world, self.store_timeout_s = desired_world, store_timeout_s
        self.hub, self.membership, self.emit = hub, membership, on_event
        self.decisions: list[dict[str, Any]] = []  # this process's decisions as leader, this incident
        self.read_ahead = ReadAhead(
            advertise=advertise, store_timeout_s=store_timeout_s, membership=membership,
            desired_world=self.desired_world_now,
        )  # fmt: skip
        self._pending: PendingCommit | None = None  # a join's compare-and-set, not yet answered

    def ahead(self) -> Ahead | None:
        """See :meth:`worker.recovery.readahead.ReadAhead.ahead`."""
        return self.read_ahead.ahead()

    def write_pending(self) -> None:
        """Send a join's compare-and-set (the leader, before the hand-over's final all-gather:
        see :mod:`worker.recovery.joincommit`). A no-op without one, and once sent."""
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
        self.read_ahead.close()

    def lead(
        self,
        old: GenRecord | None,
        *,
        dead: set[str],
        since: float,
        gathering: tuple[GenRecord, int] | None = None,
        planned: bool = False,
    ) -> Order | Refused:
        """Lead the re-formation of ``old`` (None: the first generation, claimed by ``gathering``):
        decide, write the generation, tell the members; or follow a newer generation, or refuse."""
        self.hub.lead()
        with contextlib.suppress(NotCommitted):  # a join's write still in flight: let etcd settle first
            self.settle()
        ahead = self.read_ahead.take(old, planned=planned)
        current: GenRecord | None
        if gathering is not None:
            current, revision = gathering
        elif ahead is not None:
            current, revision = ahead.current, ahead.revision
        else:
            current, revision = self.read_generation()
        if supersedes(current, old):
            assert current is not None
            return self._stale(current)
        decision = self._decide(old, dead, since, ahead)
        if not isinstance(decision, Form):
            return decision
        join = announced_first(planned=planned, old=old, lost=decision.lost, leaving=decision.leaving)
        order = self._commit(decision, old, current, revision, since, background=join)
        if order is None and ahead is not None:  # the read-ahead's revision went stale: read, try once more
            current, revision = self.read_generation()
            if supersedes(current, old):
                assert current is not None
                return self._stale(current)
            order = self._commit(decision, old, current, revision, since)
        if order is None:
            winner, _ = self.read_generation()
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
                self.hub.tell(told, fallback(decision.reason))
                return Refused("fallback", decision.reason)
            if isinstance(decision, Form):
                return decision
            if old is not None and now - probed > 0.5:
                probed = now
                found = probe_silent(old, view.checked_in | view.dead)
                if found - dead:
                    dead |= found
                    continue  # decide again at once
            if old is not None and now - read > 2.0:
                read = now
                current, _ = self.read_generation()
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
        host = self.read_ahead.take_host()
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
        answer = await_answer(link, time.time() + self.store_timeout_s)
        if answer is None or answer["t"] == "not_leader":
            return Refused(
                "fallback", f"the leader of generation {current.generation} did not take this member"
            )
        return order_from(answer, link)

    def read_generation(self) -> tuple[GenRecord | None, int]:
        """The generation record and its revision; a short etcd outage is waited out."""
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


def probe_silent(old: GenRecord, known: frozenset[str]) -> set[str]:
    """The members of ``old`` not in ``known`` whose control port refuses a probe (dead)."""
    return {m for m, a in zip(old.members, old.addrs, strict=True) if m not in known and probe(a) is False}
