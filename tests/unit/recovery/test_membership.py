"""The group's etcd keys on the in-memory store: the key layout under the job's rendezvous prefix,
entries kept alive by a lease, one winner of two concurrent generation writes."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.waiting import eventually
from worker.recovery.membership import Keys, KeyValueUnavailable, Membership, MemoryKeyValue
from worker.recovery.records import Desired, GenRecord, MemberInfo, RecordError, dump


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(generation: int, leader: str) -> GenRecord:
    return GenRecord(generation, (leader,), ("h:1",), leader, "h:1", "h:2", 1)


def test_keys_live_under_the_jobs_rendezvous_prefix() -> None:
    keys = Keys("job-7")
    assert keys.gen == "/elastrain/rdzv/job-7/group/gen"
    assert keys.member("m1") == "/elastrain/rdzv/job-7/group/members/m1"
    assert keys.desired == "/elastrain/rdzv/job-7/group/desired"
    assert keys.incident("job-7/g3") == "/elastrain/rdzv/job-7/group/incidents/job-7_g3"
    for bad in ["", "a/b", "../x", "x" * 200, "sp ace"]:
        with pytest.raises(ValueError, match="job id"):
            Keys(bad)


def test_entry_lives_with_its_lease_and_comes_back_after_expiry() -> None:
    clock = Clock()
    kv = MemoryKeyValue(clock)
    ours = Membership(kv, "job", ttl_s=10, keepalive_s=0.01)
    info = MemberInfo("m1", "member", "h:5", pid=42)
    ours.register(info)
    try:
        assert ours.members() == {"m1": info}
        ours.update(MemberInfo("m1", "member", "h:5", pid=42, generation=3))
        eventually("the update is written", lambda: ours.members()["m1"].generation == 3)
        clock.now += 11  # etcd away longer than the TTL: the entry expired with its lease
        eventually("the entry is back under a new lease", lambda: "m1" in ours.members())
    finally:
        ours.close()
    assert ours.members() == {}  # revoked: the entry is gone at once
    ours.close()  # idempotent


def test_one_of_two_concurrent_leaders_wins_the_generation() -> None:
    kv = MemoryKeyValue()
    a, b = Membership(kv, "job"), Membership(kv, "job")
    assert a.generation() == (None, 0)
    assert a.commit_generation(record(0, "a"), revision=0)
    current, revision = b.generation()
    assert current == record(0, "a")
    assert a.commit_generation(record(1, "a"), revision=revision)
    assert not b.commit_generation(record(1, "b"), revision=revision)  # read before a's write
    winner, _ = b.generation()
    assert winner is not None and winner.leader == "a" and winner.generation == 1


def test_desired_and_bad_records() -> None:
    kv = MemoryKeyValue()
    group = Membership(kv, "job")
    assert group.desired() is None
    kv.put(group.keys.desired, dump({"nodes": 3, "spares": 1, "epoch": 2}))
    assert group.desired() == Desired(3, 1, 2)
    kv.put(group.keys.gen, b'{"generation": "x"}')
    with pytest.raises(RecordError, match="generation"):
        group.generation()
    kv.put(group.keys.member("junk"), b"not json")
    assert group.members() == {}  # an entry that does not parse is skipped
    group.put_incident("job/g1", {"kind": "peer"})
    assert kv.get(group.keys.incident("job/g1")) is not None


def test_an_unavailable_store_is_reported_not_hidden() -> None:
    kv = MemoryKeyValue()
    group = Membership(kv, "job", keepalive_s=0.01)
    group.register(MemberInfo("m1", "spare", "h:1"))
    kv.available = False
    eventually("the lease thread records the error", lambda: "unavailable" in group.last_error)
    with pytest.raises(KeyValueUnavailable):
        group.generation()
    group.close()  # revoking fails quietly: the lease expires on its own
    kv.available = True
    assert kv.get(group.keys.member("m1")) is not None  # still there until its TTL runs out


def test_memory_store_semantics() -> None:
    kv = MemoryKeyValue()
    assert kv.compare_and_set("k", b"1", revision=0)
    assert not kv.compare_and_set("k", b"2", revision=0)
    stamped = kv.get("k")
    assert stamped is not None and stamped.value == b"1"
    assert kv.compare_and_set("k", b"2", revision=stamped.revision)
    kv.delete("k")
    kv.delete("k")
    assert kv.get("k") is None
    with pytest.raises(KeyValueUnavailable, match="lease"):
        kv.put("x", b"1", lease=123)


def test_a_re_formed_members_entry_is_written_when_it_is_published_not_at_the_re_formation() -> None:
    """The entry's new role, generation and version wait for publish() (worker.peer.loop calls it
    after the generation's first step): the lease thread's write kept off the join's window."""
    from worker.recovery.handover import Handed
    from worker.recovery.plan import Policy
    from worker.recovery.recover import GroupMember
    from worker.recovery.seam import RecoveryConfig

    kv = MemoryKeyValue(Clock())
    policy = Policy(min_world=1, max_world=2)
    cfg = RecoveryConfig(job_id="job", secret=b"s" * 16, spec_hash="h", policy=policy)
    member = GroupMember(cfg, kv=kv)
    me = member.member_id
    member.membership.register(member.me)  # as start() does (without the control server)
    try:
        member.record = GenRecord(4, (me,), ("h:1",), me, "h:1", "h:2", 1)
        member._outcome(Handed("peer", version=7), member.record, None, {}, 1)
        assert (member.me.generation, member.me.version) == (4, 7)  # this process knows at once
        time.sleep(0.1)
        assert member.membership.members()[me].role == "joiner"  # nothing written yet
        member.publish()
        eventually(
            "the entry is published",
            lambda: member.membership.members()[me] == dataclasses.replace(member.me, role="member"),
        )
        member.publish()  # nothing new: a no-op
    finally:
        member.membership.close()
