"""Who forms the next generation, from a member's side: find the leader and check in, or wait to
be called.

* A member of the broken generation tries its candidates in order (the old leader, then the
  members by rank): a refused connection means that candidate is dead, the next is tried; the
  first living one gets this member's check-in and answers (:mod:`worker.recovery.answers`). A
  member that reaches itself in the list leads (:mod:`worker.recovery.leader`).
* A newcomer (spare or joiner) connects to the recorded leader and waits to be called. When no
  generation exists yet, or every member of the recorded one is gone, joiners write a
  ``gathering`` record by compare-and-set; the winner leads the first generation (a spare never
  leads: its warmed-up state is not the job's).
"""

from __future__ import annotations

import dataclasses
import time

from worker.recovery.answers import ACK_TIMEOUT_S, ANSWERS, TIMEOUT, Order, Refused, await_answer, order_from
from worker.recovery.control import ControlError, Link, connect
from worker.recovery.hub import Hub
from worker.recovery.leader import Leader
from worker.recovery.membership import Membership
from worker.recovery.records import Checkin, GenRecord


class Resolver:
    """This process's way into the next generation; ``leader`` is its side as the leader (whose
    member, secret, policy, hub and membership it shares)."""

    def __init__(self, leader: Leader) -> None:
        self.leader = leader
        self.me, self.secret, self.policy = leader.me, leader.secret, leader.policy
        self.hub: Hub = leader.hub
        self.membership: Membership = leader.membership

    def close(self) -> None:
        """Stop serving a store hosted ahead and not used. Idempotent."""
        self.leader.close()

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
            if link.step is not None:  # the leader's beacon: the step it completed, if it is the one lost
                self.hub.steps[old.leader] = link.step
        deadline = checkin.failed_at + self.policy.join_window_s + self.policy.replacement_timeout_s + 30.0
        while time.time() < deadline:
            for member_id, address in old.candidates():
                if member_id in dead:
                    continue
                if member_id == self.me.member_id:
                    return self.leader.lead(old, dead=dead, since=checkin.failed_at, planned=planned)
                try:
                    link = self._link_to(address, link)
                except (OSError, ControlError):  # refused (dead), or unreachable within the timeout
                    dead.add(member_id)
                    continue
                self.hub.follow()
                report = dataclasses.replace(checkin, dead=tuple(sorted(dead)))
                link.send({"t": "checkin", "checkin": report.to_json()})
                answer = await_answer(link, min(deadline, time.time() + ACK_TIMEOUT_S), (*ANSWERS, "ack"))
                if answer is not None and answer["t"] == "ack":
                    answer = await_answer(link, deadline)
                if answer is None or answer.get("reason") == TIMEOUT:
                    dead.add(member_id)
                    continue
                if answer["t"] == "not_leader":
                    break
                return order_from(answer, link)
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
                answer = await_answer(link, None)
                if answer is not None and answer["t"] != "not_leader":
                    return order_from(answer, link)
                link.close()
                time.sleep(0.1)
            current, revision = self.leader.read_generation()
            link = self._reach(current)
            if link is None and self.me.role == "spare":  # a spare never leads: it waits for members
                time.sleep(0.2)
            elif link is None:
                won = self._gather(current, revision)
                if won is not None:
                    return self.leader.lead(None, dead=set(), since=time.time(), gathering=won)
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
        _, new_revision = self.leader.read_generation()
        return record, new_revision
