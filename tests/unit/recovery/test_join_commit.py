"""A join's generation is announced first and written on a thread (worker.recovery.joincommit): the
write's answer, the leader's refusal to vote in a generation etcd does not hold, and the two
rules that keep such a generation harmless (the next number, and a record of the same number
that is not the held one being newer)."""

from __future__ import annotations

import dataclasses

import pytest

from worker.recovery.failure import classify
from worker.recovery.hub import Hub
from worker.recovery.joincommit import PendingCommit, announced_first, next_generation, supersedes
from worker.recovery.leader import Leader
from worker.recovery.membership import Membership, MemoryKeyValue
from worker.recovery.plan import Policy
from worker.recovery.records import GenRecord, MemberInfo
from worker.recovery.vote import NotCommitted


def record(generation: int, leader: str = "a", members: tuple[str, ...] = ("a", "b")) -> GenRecord:
    addrs = tuple(f"h:{m}" for m in members)
    return GenRecord(generation, members, addrs, leader, f"h:{leader}", "h:s", len(members), formed_at=5.0)


def written(kv: MemoryKeyValue, first: GenRecord) -> tuple[Membership, int]:
    membership = Membership(kv, "job-1")
    assert membership.commit_generation(first, revision=0)
    _, revision = membership.generation()
    return membership, revision


def test_a_record_of_the_same_number_that_is_not_the_held_one_is_newer() -> None:
    held = record(4, members=("a", "b", "c"))
    assert not supersedes(held, held)
    assert not supersedes(GenRecord.from_json(held.to_json()), held), "the same record, read back"
    assert supersedes(record(4, leader="b"), held), "another leader's generation 4"
    assert supersedes(record(5), held)
    assert not supersedes(record(3), held), "etcd behind the held generation: it was never written"
    assert not supersedes(None, held) and not supersedes(held, None)


def test_the_next_number_is_past_etcd_and_the_held_generation() -> None:
    assert next_generation(record(3), record(4)) == 5, "4 was announced and never written"
    assert next_generation(record(4), record(4)) == 5
    assert next_generation(record(6), record(4)) == 7
    assert next_generation(None, None) == 0


def test_the_write_lands_and_says_so() -> None:
    kv = MemoryKeyValue()
    membership, revision = written(kv, record(0))
    join = record(1, members=("a", "b", "c"))
    pending = PendingCommit(membership, join, revision)
    assert membership.generation()[0] == record(0), "nothing is sent before start()"
    pending.start()
    assert pending.result(5.0) is None
    assert membership.generation()[0] == join


def test_a_write_another_leader_beat_is_refused_and_etcd_keeps_the_winner() -> None:
    kv = MemoryKeyValue()
    membership, revision = written(kv, record(0))
    winner = record(1, leader="b", members=("b",))
    assert membership.commit_generation(winner, revision=revision)
    pending = PendingCommit(membership, record(1, members=("a", "b", "c")), revision)
    pending.start()
    reason = pending.result(5.0)
    assert reason is not None and "another leader" in reason
    assert membership.generation()[0] == winner


def test_an_unanswered_write_says_the_outcome_is_unknown() -> None:
    kv = MemoryKeyValue()
    membership, revision = written(kv, record(0))
    kv.available = False
    pending = PendingCommit(membership, record(1), revision)
    pending.start()
    reason = pending.result(5.0)
    assert reason is not None and "may or may not" in reason


def test_a_write_never_sent_says_so() -> None:
    membership, revision = written(MemoryKeyValue(), record(0))
    reason = PendingCommit(membership, record(1), revision).result(5.0)  # the group did not form
    assert reason is not None and "not sent" in reason
    assert membership.generation()[0] == record(0)


def test_the_leader_refuses_to_vote_in_a_generation_etcd_does_not_hold() -> None:
    kv = MemoryKeyValue()
    membership, revision = written(kv, record(0))
    assert membership.commit_generation(record(1, leader="b"), revision=revision)
    events: list[tuple[str, dict[str, object]]] = []
    me = MemberInfo("a", "member", "h:a", "", 0, 0, 1)
    leader = Leader(
        me=me, secret=b"s" * 32, advertise="127.0.0.1", policy=Policy(min_world=1, max_world=3),
        desired_world=3, store_timeout_s=5.0, hub=Hub(me), membership=membership,
        on_event=lambda name, fields: events.append((name, fields)),
    )  # fmt: skip
    leader.settle()  # nothing pending: nothing to wait for
    leader._pending = PendingCommit(membership, record(1, members=("a", "b", "c")), revision)
    leader.write_pending()
    with pytest.raises(NotCommitted, match="generation 1 was announced, not written"):
        leader.settle()
    assert events == [("generation_not_committed", {"generation": 1, "reason": events[0][1]["reason"]})]
    leader.settle()  # answered once: the next vote is the group's own business


def test_the_refusal_breaks_the_window_like_a_fence() -> None:
    failure = classify(NotCommitted("generation 1 was announced, not written: ..."))
    assert failure.kind == "fenced" and failure.recoverable


def test_records_compare_by_every_field() -> None:
    held = record(2)
    assert supersedes(dataclasses.replace(held, store="h:other"), held)


def test_a_join_is_announced_first_whether_or_not_the_record_was_read_ahead() -> None:
    old = record(3)
    assert announced_first(planned=True, old=old, lost=(), leaving=())  # read ahead or just now alike
    assert not announced_first(planned=False, old=old, lost=(), leaving=()), "a failure writes first"
    assert not announced_first(planned=True, old=old, lost=("b",), leaving=()), "a member lost on the way"
    assert not announced_first(planned=True, old=old, lost=(), leaving=("b",)), "a node leaving"
    assert not announced_first(planned=True, old=None, lost=(), leaving=()), "the first generation"
