"""What one process knows about the members that talk to it over the control channel.

Every process runs a hub behind its :class:`~worker.recovery.control.ControlServer` (whoever is
the next leader must already be listening); it matters on the leader, where it holds each
member's connection (an EOF is that member's death, timed: its last sign of life), the
check-ins of a failure, and the connected spares and joiners. The server's connection threads
update it; the training thread reads :meth:`Hub.view` for :func:`worker.recovery.plan.decide` and
waits on it for the next change. A check-in from an older generation is answered at once on the
connection's thread: ``form`` if the sender is in the current generation, else ``fenced`` — so a
stalled rank that wakes up is fenced even while the leader trains. A check-in that is kept is
acknowledged at once (``ack``): a candidate whose process is stopped acknowledges nothing, and
the member moves on to the next candidate after ``ACK_TIMEOUT_S``.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Protocol

from worker.recovery.control import Conn, Message, bye_time, split_address
from worker.recovery.plan import Newcomer, View
from worker.recovery.records import Checkin, GenRecord, MemberInfo, RecordError

IDLE, LEADING, FOLLOWING = "idle", "leading", "following"


class Ended(Protocol):
    """A connection whose other end's last sign of life may become known (a Link)."""

    @property
    def lost_at(self) -> float | None: ...


class Hub:
    def __init__(self, me: MemberInfo) -> None:
        self.me = me
        self.cond = threading.Condition()
        self.conns: dict[str, Conn] = {}
        self.roles: dict[str, int] = {}  # connections by their peer's role
        self.closed: dict[str, float] = {}  # member id -> its last sign of life, once its connection closed
        self.byes: dict[str, float] = {}  # member id -> when its node died, as it said before its EOF
        self.links: dict[str, Ended] = {}  # old leader -> this process's connection to it
        self.checkins: dict[str, Checkin] = {}
        self.steps: dict[str, int] = {}  # member id -> the last step it said it completed (``at``)
        self.infos: dict[str, MemberInfo] = {}  # every process that said hello, as it did
        self.current: GenRecord | None = None  # the formed generation this process belongs to
        self.mode = IDLE
        self.changes = 0  # counts what the leader waits for (hellos, ends, check-ins): see wait()

    # -- the control server's callbacks (connection threads) --------------------------------
    def on_hello(self, conn: Conn) -> None:
        with self.cond:
            old = self.conns.get(conn.peer.member_id)
            self.conns[conn.peer.member_id] = conn
            self._count(conn, 1)
            if old is not None:
                self._count(old, -1)
            self.infos[conn.peer.member_id] = conn.peer
            self.closed.pop(conn.peer.member_id, None)
            self.byes.pop(conn.peer.member_id, None)
            self._changed()
            turned_away = self.mode == FOLLOWING and conn.peer.role in ("spare", "joiner")
        if old is not None and old is not conn:
            old.close()
        if turned_away:  # a newcomer looking for the leader: not here
            conn.send({"t": "not_leader"})

    def _count(self, conn: Conn, change: int) -> None:
        role = conn.peer.role
        self.roles[role] = self.roles.get(role, 0) + change

    def on_close(self, conn: Conn, when: float) -> None:
        """A connection ended: its member's last sign of life is recorded, and when it was a
        member of this process's generation the other members connected here are told (``lost``):
        a member connected to this leader alone hears of nobody else's end otherwise, and one
        waiting for a save's answer stops waiting on it (:meth:`GroupMember.lost_member`)."""
        member = conn.peer.member_id
        notice: Message | None = None
        others: set[str] = set()
        with self.cond:
            if self.conns.get(member) is conn:
                del self.conns[member]
                self._count(conn, -1)
                self.closed[member] = min(when, self.byes.pop(member, when))
                self._changed()
                if self.current is not None and member in self.current.members:
                    notice = {"t": "lost", "member": member, "generation": self.current.generation}
                    others = set(self.current.members) - {member}
        if notice is not None:
            self.tell(others, notice)

    def lost_link(self, member_id: str, link: Ended) -> None:
        """This process's own connection to ``member_id`` (the old leader): its end is the
        leader's last sign of life, as :meth:`on_close` records a member's. Read now and again
        whenever a failure is timed (:meth:`last_sign`): a member's collective can fail before its
        connection's reader has seen the EOF. Kept only for a member not connected here now."""
        with self.cond:
            if member_id not in self.conns:
                self.links.setdefault(member_id, link)
                if link.lost_at is not None:
                    self.closed.setdefault(member_id, link.lost_at)
                self._changed()

    def last_sign(self, lost: tuple[str, ...]) -> float | None:
        """The earliest last sign of life this process knows of the ``lost`` members (their
        connections' ends, their byes), or None."""
        with self.cond:
            times = [self.closed[m] for m in lost if m in self.closed]
            times += [t for m in lost if m in self.links and (t := self.links[m].lost_at) is not None]
        return min(times) if times else None

    def on_message(self, conn: Conn, msg: Message) -> None:
        if msg["t"] == "ping":
            conn.send({"t": "pong"})
            return
        if msg["t"] == "at":  # the member's beacon: the last step it completed
            step = msg.get("step")
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                self.steps[conn.peer.member_id] = step
            return
        if msg["t"] == "bye":  # the member's node died at "at" (its agent); its EOF follows
            at = bye_time(msg, time.time())
            if at is not None:
                with self.cond:
                    self.byes[conn.peer.member_id] = at
            return
        if msg["t"] != "checkin" or not isinstance(msg.get("checkin"), dict):
            return
        try:
            checkin = Checkin.from_json(msg["checkin"])
        except RecordError:
            conn.close()
            return
        if checkin.member_id != conn.peer.member_id:
            conn.close()  # a member checks in for itself only
            return
        reply = self._admit(checkin)
        if reply is not None:
            conn.send(reply)

    def _admit(self, checkin: Checkin) -> Message | None:
        with self.cond:
            current = self.current
            if current is not None and checkin.generation < current.generation:
                if checkin.member_id not in current.members:
                    return {"t": "fenced", "generation": current.generation}
                if self.mode == LEADING:
                    return {"t": "form", "record": current.to_json()}
                return {"t": "not_leader"}
            if self.mode == FOLLOWING:
                return {"t": "not_leader"}
            self.checkins[checkin.member_id] = checkin
            self._changed()
            return {"t": "ack"}  # alive; the answer comes when this process has decided

    # -- the training thread ---------------------------------------------------------------
    def follow(self) -> None:
        """This process found a living leader: send away whoever checked in or waits here."""
        with self.cond:
            self.mode = FOLLOWING
            members = set(self.current.members) if self.current is not None else set()
            waiting = [self.conns[m] for m in self.checkins if m in self.conns]
            waiting += [
                c for m, c in self.conns.items() if m not in members and c.peer.role in ("spare", "joiner")
            ]
            self.checkins.clear()
        for conn in waiting:
            conn.send({"t": "not_leader"})

    def lead(self) -> None:
        with self.cond:
            self.mode = LEADING

    def view(self, old: GenRecord | None, *, dead: set[str], since: float, desired_world: int | None) -> View:
        """The inputs of :func:`worker.recovery.plan.decide` as of now."""
        members = old.members if old is not None else ()
        generation = old.generation if old is not None else None
        with self.cond:
            checked = {m for m, c in self.checkins.items() if c.generation == generation and m in members}
            checked.add(self.me.member_id)
            gone = set(dead) | set(self._ended(members))
            for c in self.checkins.values():
                if c.generation == generation:
                    gone |= set(c.dead)
            newcomers = tuple(
                Newcomer(m, c.peer.role, c.peer.order)
                for m, c in sorted(self.conns.items())
                if m not in members and c.peer.role in ("spare", "joiner")
            )
        if old is None:
            newcomers += (Newcomer(self.me.member_id, "joiner", self.me.order),)
        return View(
            old=members, checked_in=frozenset(checked & set(members)), dead=frozenset(gone - checked),
            newcomers=newcomers, leader=self.me.member_id, since=since, desired_world=desired_world,
        )  # fmt: skip

    def info_of(self, member_id: str) -> MemberInfo | None:
        with self.cond:
            return self.infos.get(member_id)

    def failed_at(self, lost: tuple[str, ...], old: GenRecord | None, since: float) -> float | None:
        """The lost members' last sign of life: the EOF of their connection to this process (a
        member's to this leader, or this process's own to the old leader: :meth:`lost_link`),
        else (it was connected elsewhere) the first failure a survivor saw. None without a
        failure."""
        known = self.last_sign(lost)
        if known is not None:
            return known
        return self.detected_at(old, since) if lost else None

    def detected_at(self, old: GenRecord | None, since: float) -> float | None:
        """The first failure a member of ``old`` reported (this process's own at ``since``)."""
        if old is None:
            return None
        with self.cond:
            times = [c.failed_at for c in self.checkins.values() if c.generation == old.generation]
        return min([*times, since])

    def _changed(self) -> None:
        """Under ``cond``: something a waiting leader decides on changed."""
        self.changes += 1
        self.cond.notify_all()

    def wait(self, timeout: float, *, seen: int) -> bool:
        """Until something changes after ``seen`` (the :attr:`changes` the caller read before
        its view), or ``timeout``. A change between the view and this wait ends it at once: the
        leader no longer sleeps through a check-in that came in meanwhile (it did, up to 0.5 s,
        once the read-ahead brought it to its decision before the members' check-ins). Whether
        something changed."""
        with self.cond:
            return self.cond.wait_for(lambda: self.changes != seen, max(timeout, 0.0))

    def announce(self, record: GenRecord, *, leaving: tuple[str, ...]) -> list[str]:
        """Send ``form`` to the new generation's members and ``leave`` to those left out;
        returns the members that could not be told."""
        with self.cond:
            self.current, self.mode = record, LEADING
            self.checkins = {m: c for m, c in self.checkins.items() if c.generation >= record.generation}
            conns = dict(self.conns)
        missed = []
        for member in record.members:
            if member != self.me.member_id:
                conn = conns.get(member)
                if conn is None or not conn.send({"t": "form", "record": record.to_json()}):
                    missed.append(member)
        for member in leaving:
            if member in conns:
                conns[member].send({"t": "leave"})
        return missed

    def formed(self, record: GenRecord, *, leading: bool) -> None:
        with self.cond:
            self.current = record
            self.mode = LEADING if leading else IDLE
            self.checkins = {m: c for m, c in self.checkins.items() if c.generation >= record.generation}

    def tell(self, members: set[str] | None, msg: Message) -> None:
        """Send ``msg`` to ``members`` connected here; None: on every connection (members,
        spares, joiners)."""
        with self.cond:
            conns = [c for m, c in self.conns.items() if members is None or m in members]
        for conn in conns:
            conn.send(msg)

    def standby(self, record: GenRecord) -> set[str]:
        """Connected processes that are not members of ``record``."""
        with self.cond:
            return {m for m in self.conns if m not in record.members}

    def checked_in(self, generation: int) -> set[str]:
        with self.cond:
            return {m for m, c in self.checkins.items() if c.generation == generation}

    def gone(self, record: GenRecord) -> str | None:
        """A member of ``record`` (not this process) whose connection here ended, or None."""
        with self.cond:
            return next(iter(self._ended(record.members)), None)

    def _ended(self, members: tuple[str, ...]) -> list[str]:
        """Under ``cond``: the ``members`` whose connection here ended (and did not come back)."""
        return [m for m in members if m in self.closed and m not in self.conns]

    def waiting(self, role: str) -> int:
        """Connected newcomers of ``role`` (``joiner``: the leader admits them; ``spare``: standing
        by) that are not members of the current generation. The leader asks at every window: with
        nobody of that role connected it answers without the lock (a dict read is atomic)."""
        if not self.roles.get(role):
            return 0
        with self.cond:
            members = set(self.current.members) if self.current else set()
            return sum(1 for m, c in self.conns.items() if m not in members and c.peer.role == role)


def probe(address: str, timeout_s: float = 0.5) -> bool | None:
    """Is anything listening at ``address``? False when the connection is refused (the process
    is gone), True when accepted, None when unknown (timeout, unreachable)."""
    try:
        host, port = split_address(address)
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return False
    except (OSError, ValueError):
        return None


def message_record(msg: Message) -> GenRecord:
    raw: Any = msg.get("record")
    if not isinstance(raw, dict):
        raise RecordError("form: no record")
    return GenRecord.from_json(raw, what="form record")
