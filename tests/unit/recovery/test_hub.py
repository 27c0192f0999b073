"""The leader's view of its members (worker.recovery.hub) on fake connections: deaths timed by
EOF, check-ins kept and acknowledged, a stale member fenced at once, newcomers listed, answers
sent to the right members."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any, cast

from worker.recovery.control import Conn, Link
from worker.recovery.hub import Hub
from worker.recovery.records import Checkin, GenRecord, MemberInfo


class FakeConn:
    def __init__(self, member_id: str, role: str = "member", node: int = 0) -> None:
        self.peer = MemberInfo(member_id, role, f"h:{member_id}", node_index=node)
        self.sent: list[dict[str, Any]] = []
        self.closed = False

    def send(self, msg: dict[str, Any]) -> bool:
        self.sent.append(msg)
        return True

    def close(self) -> None:
        self.closed = True


@dataclass
class Ended:
    lost_at: float | None


RECORD = GenRecord(3, ("a", "b", "c"), ("h:a", "h:b", "h:c"), "a", "h:a", "h:s", 3)


def hub_with(*conns: FakeConn) -> Hub:
    hub = Hub(MemberInfo("a", "member", "h:a"))
    hub.formed(RECORD, leading=True)
    for conn in conns:
        hub.on_hello(cast(Conn, conn))
    return hub


def checkin(hub: Hub, conn: FakeConn, generation: int = 3) -> None:
    body = Checkin(conn.peer.member_id, generation, 10, True, 5.0, "RuntimeError: x", True)
    hub.on_message(cast(Conn, conn), {"t": "checkin", "checkin": body.to_json()})


def test_eof_is_a_timed_death_and_checkins_are_acknowledged() -> None:
    b, c, s = FakeConn("b"), FakeConn("c"), FakeConn("s", "spare", node=7)
    hub = hub_with(b, c, s)
    hub.on_close(cast(Conn, c), 12.5)
    checkin(hub, b)
    assert b.sent == [{"t": "lost", "member": "c", "generation": 3}, {"t": "ack"}]
    view = hub.view(RECORD, dead=set(), since=5.0, desired_world=None)
    assert view.checked_in == frozenset({"a", "b"}) and view.dead == frozenset({"c"})
    assert [(n.member_id, n.role) for n in view.newcomers] == [("s", "spare")]
    assert hub.failed_at(("c",), RECORD, 20.0) == 12.5  # c's connection closed at 12.5
    assert hub.failed_at(("z",), RECORD, 20.0) == 5.0  # z was connected elsewhere: b saw a failure at 5.0
    assert hub.detected_at(RECORD, 20.0) == 5.0 and hub.detected_at(None, 20.0) is None


def test_a_member_of_an_older_generation_is_fenced_at_once() -> None:
    stale, late = FakeConn("x"), FakeConn("b")
    hub = hub_with(stale, late)
    checkin(hub, stale, generation=2)
    assert stale.sent == [{"t": "fenced", "generation": 3}]
    checkin(hub, late, generation=2)  # listed in generation 3: it is told to form it
    assert late.sent[0]["t"] == "form" and late.sent[0]["record"]["generation"] == 3
    assert hub.checked_in(2) == set()


def test_a_follower_turns_check_ins_and_newcomers_away() -> None:
    b, s = FakeConn("b"), FakeConn("s", "joiner")
    hub = hub_with(b, s)
    hub.formed(RECORD, leading=False)
    checkin(hub, b)
    assert b.sent == [{"t": "ack"}]  # kept: this process may lead the next generation
    hub.follow()
    assert b.sent[-1] == {"t": "not_leader"} and s.sent[-1] == {"t": "not_leader"}
    checkin(hub, b)
    assert b.sent[-1] == {"t": "not_leader"}


def test_announce_tells_members_and_leavers_and_counts_joiners() -> None:
    b, c, j, s = FakeConn("b"), FakeConn("c"), FakeConn("j", "joiner"), FakeConn("s", "spare")
    hub = hub_with(b, c, j, s)
    assert hub.waiting("joiner") == 1 and hub.waiting("spare") == 1
    record = GenRecord(4, ("a", "b", "j"), ("h:a", "h:b", "h:j"), "a", "h:a", "h:s2", 3)
    missed = hub.announce(record, leaving=("c",))
    assert missed == []
    assert b.sent[-1]["t"] == "form" and j.sent[-1]["record"]["members"] == ["a", "b", "j"]
    assert c.sent[-1] == {"t": "leave"}
    assert hub.waiting("joiner") == 0
    assert hub.standby(record) == {"c", "s"}  # the spare still stands by


def test_a_bad_or_foreign_check_in_closes_the_connection() -> None:
    b = FakeConn("b")
    hub = hub_with(b)
    hub.on_message(cast(Conn, b), {"t": "checkin", "checkin": {"member_id": "b"}})
    assert b.closed
    other = FakeConn("c")
    hub.on_hello(cast(Conn, other))
    body = Checkin("b", 3, 1, True, 1.0).to_json()  # c speaks for b
    hub.on_message(cast(Conn, other), {"t": "checkin", "checkin": body})
    assert other.closed and hub.checked_in(3) == set()
    hub.on_message(cast(Conn, other), {"t": "ping"})
    assert other.sent[-1] == {"t": "pong"}


def test_a_lost_leaders_last_sign_of_life_is_when_this_members_link_to_it_ended() -> None:
    hub = Hub(MemberInfo("b", "member", "h:b"))  # b, not the leader: a led generation 3
    hub.formed(RECORD, leading=False)
    assert hub.failed_at(("a",), RECORD, 20.0) == 20.0  # nothing seen: this member's own detection
    hub.lost_link("a", Ended(12.5))  # b's connection to a ended at 12.5, before b's collective failed at 20
    hub.lost_link("a", Ended(19.0))  # the first link counts
    assert hub.failed_at(("a",), RECORD, 20.0) == 12.5
    assert hub.view(RECORD, dead=set(), since=20.0, desired_world=None).dead == frozenset({"a"})


def test_a_member_whose_node_died_is_timed_from_its_bye_not_its_eof() -> None:
    """A worker whose torchrun agent died says so (``bye`` with the agent's end) before its own
    end; the incident starts at the agent's end. A bye from the future, from long ago, or not a
    number is ignored: the EOF counts."""
    b, c, d = FakeConn("b"), FakeConn("c"), FakeConn("d")
    hub = hub_with(b, c, d)
    now = time.time()
    hub.on_message(cast(Conn, b), {"t": "bye", "at": now - 0.03})
    hub.on_close(cast(Conn, b), now)
    assert hub.failed_at(("b",), RECORD, now + 1) == now - 0.03
    for junk in (now + 5, now - 3600, "soon", True, None):
        hub.on_message(cast(Conn, c), {"t": "bye", "at": junk})
    hub.on_close(cast(Conn, c), now)
    assert hub.failed_at(("c",), RECORD, now + 1) == now
    hub.tell(None, {"t": "bye", "at": now})
    assert d.sent == [{"t": "bye", "at": now}] and b.sent == []
    assert [m for m in c.sent if m["t"] == "bye"] == []


def test_a_leaders_bye_is_its_links_end() -> None:
    """A member's link to a leader whose node died: ``closed_at`` is the time the bye gave, and
    the bye is not handed to the training thread as a message."""
    left, right = socket.socketpair()
    link = Link(Conn(left, MemberInfo("a", "member", "h:a")), "h:a")
    at = time.time() - 0.05
    right.sendall(b'{"t":"bye","at":%r}\n{"t":"pong"}\n' % at)
    right.close()
    assert link.recv(5) == {"t": "pong"} and link.recv(5) is None
    assert link.lost_at == at and link.closed_at is not None and link.closed_at >= at


def test_a_leaders_end_seen_after_the_decision_still_times_the_failure() -> None:
    """b's collective failed (20.0) before its link's reader saw the leader's EOF: the link is
    read again when the failure is timed, so the EOF (12.5) counts once it is known."""
    hub = Hub(MemberInfo("b", "member", "h:b"))
    hub.formed(RECORD, leading=False)
    link = Ended(None)
    hub.lost_link("a", link)
    assert hub.failed_at(("a",), RECORD, 20.0) == 20.0 and hub.last_sign(("a",)) is None
    link.lost_at = 12.5
    assert hub.failed_at(("a",), RECORD, 20.0) == 12.5 and hub.last_sign(("a",)) == 12.5


def test_a_link_closed_by_this_member_is_no_sign_of_the_leaders_death() -> None:
    left, right = socket.socketpair()
    link = Link(Conn(left, MemberInfo("a", "member", "h:a")), "h:a")
    link.close()
    assert link.recv(5) is None
    assert link.closed_at is not None and link.lost_at is None
    right.close()


def test_a_checkin_between_the_view_and_the_wait_ends_the_wait() -> None:
    """The leader reads ``changes``, takes its view (b has not checked in: wait), and b's
    check-in lands before the leader waits: the wait returns at once instead of sleeping through
    it (without the count it slept its whole timeout, 0.5 s in the resolver; 60 s here)."""
    b = FakeConn("b")
    hub = hub_with(b, FakeConn("c"))
    seen = hub.changes
    assert "b" not in hub.view(RECORD, dead=set(), since=5.0, desired_world=None).checked_in
    checkin(hub, b)
    assert hub.wait(60.0, seen=seen), "the check-in after the view is a change"
    assert not hub.wait(0.0, seen=hub.changes), "nothing new since: the wait times out"


def test_a_members_end_is_told_to_the_other_members_connected_to_the_leader() -> None:
    """At three members a member connected to the leader alone hears of another member's end
    from the leader (``lost``, with the generation), so a save waiting for the service stops
    waiting; a spare's end is nobody's loss, and spares are not told."""
    b, c, s = FakeConn("b"), FakeConn("c"), FakeConn("s", "spare", node=7)
    hub = hub_with(b, c, s)
    hub.on_close(cast(Conn, s), 10.0)
    assert b.sent == c.sent == []
    hub.on_close(cast(Conn, c), 11.0)
    assert b.sent == [{"t": "lost", "member": "c", "generation": 3}] and s.sent == []


def test_a_link_keeps_what_the_leader_said_it_lost_out_of_the_training_threads_way() -> None:
    """The notice is kept by generation (an older generation's loss does not stop this one's
    save), for members of the generation asked about; junk is ignored; the training thread's
    queue never sees it."""
    left, right = socket.socketpair()
    link = Link(Conn(left, MemberInfo("b", "member", "h:b")), "h:a")
    right.sendall(
        b'{"t":"lost","member":"c","generation":2}\n{"t":"lost","member":7,"generation":3}\n'
        b'{"t":"lost","member":"z","generation":3}\n{"t":"pong"}\n'
    )
    assert link.recv(30) == {"t": "pong"}
    assert link.lost_in(3, RECORD.members) is None
    right.sendall(b'{"t":"lost","member":"c","generation":3}\n{"t":"pong"}\n')
    assert link.recv(30) == {"t": "pong"}
    assert link.lost_in(3, RECORD.members) == "c" and link.lost_in(4, RECORD.members) is None
    right.close()
    assert link.recv(30) is None


def test_newcomers_are_counted_as_they_come_and_go() -> None:
    """The leader asks at every window whether a joiner waits; the answer follows hellos, a
    member's second connection replacing its first, and ends."""
    b = FakeConn("b")
    hub = hub_with(b)
    assert hub.waiting("joiner") == 0 and hub.waiting("spare") == 0
    j = FakeConn("j", "joiner")
    hub.on_hello(cast(Conn, j))
    again = FakeConn("j", "joiner")
    hub.on_hello(cast(Conn, again))  # the same newcomer again: its first connection is replaced
    assert j.closed and hub.waiting("joiner") == 1
    hub.on_close(cast(Conn, j), 1.0)  # the replaced connection's end changes nothing
    assert hub.waiting("joiner") == 1
    hub.on_close(cast(Conn, again), 2.0)
    assert hub.waiting("joiner") == 0 and hub.roles == {"member": 1, "joiner": 0}
