"""EtcdStore against a real etcd 3.5, and the same contract on MemoryStore: compare-and-set on
mod_revision, all-or-nothing commits, leader fencing, leases, ordered prefix listing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.etcd.election import LeaderElection
from service.etcd.kv import EtcdStore, Fence, KVStore, Write, delete_if, put_if
from service.etcd.memory import MemoryStore
from service.jobs.errors import NotLeaderError
from service.jobs.parts import JobParts
from worker.etcdclient import EtcdUnavailableError
from worker.jobspec.spec import parse_spec

pytestmark = pytest.mark.integration


@pytest.fixture(params=["etcd", "memory"])
def store(request: pytest.FixtureRequest) -> Iterator[KVStore]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        yield EtcdStore(request.getfixturevalue("etcd_endpoint"))


def test_compare_and_set(store: KVStore, etcd_prefix: str) -> None:
    key = f"{etcd_prefix}/a"
    assert store.get(key) is None
    assert put_if(store, key, b"1", 0)
    assert not put_if(store, key, b"again", 0)  # create-only
    first = store.get(key)
    assert first is not None and first.value == b"1"
    assert put_if(store, key, b"2", first.mod_revision)
    assert not put_if(store, key, b"3", first.mod_revision)  # a stale revision loses
    second = store.get(key)
    assert second is not None and second.value == b"2" and second.mod_revision > first.mod_revision
    assert not delete_if(store, key, first.mod_revision)
    assert delete_if(store, key, second.mod_revision)
    assert store.get(key) is None


def test_commit_is_all_or_nothing(store: KVStore, etcd_prefix: str) -> None:
    a, b = f"{etcd_prefix}/x", f"{etcd_prefix}/y"
    assert put_if(store, b, b"taken", 0)
    assert not store.commit([Write(a, b"1", 0), Write(b, b"1", 0)])
    assert store.get(a) is None
    assert store.commit([Write(a, b"1", 0), Write(b, b"2", None)])
    got = store.get(b)
    assert got is not None and got.value == b"2"


def test_stale_leader_is_fenced_out(store: KVStore, etcd_prefix: str) -> None:
    leader_key = f"{etcd_prefix}/leader"
    old = LeaderElection(store, "old", ttl_s=2, key=leader_key)
    fence = old.campaign()
    assert fence is not None
    assert LeaderElection(store, "new", ttl_s=2, key=leader_key).campaign() is None
    assert put_if(store, f"{etcd_prefix}/job", b"v1", 0, fence=fence)
    store.lease_revoke(fence.lease_id)  # the old leader's lease is gone (expired or revoked)
    new = LeaderElection(store, "new", ttl_s=2, key=leader_key)
    assert new.campaign() is not None
    current = store.get(f"{etcd_prefix}/job")
    assert current is not None
    assert not put_if(store, f"{etcd_prefix}/job", b"stale", current.mod_revision, fence=fence)
    assert not old.keep_alive() and old.fence is None
    assert put_if(store, f"{etcd_prefix}/job", b"v2", current.mod_revision, fence=new.fence)
    forged = Fence("new", 12345, leader_key)  # right holder, wrong lease
    assert not store.commit([], fence=forged)


def test_every_job_write_of_a_stale_leader_is_refused_by_the_store(
    store: KVStore, etcd_prefix: str, tmp_path: Path
) -> None:
    """The API's writes (submit, scale, cancel, heartbeat, progress cleanup) carry the fence: once
    another instance leads, the old leader's writes fail in etcd's transaction itself, are counted,
    and leave the job as the new leader last wrote it."""
    leader_key = f"{etcd_prefix}/leader"
    old = LeaderElection(store, "old", ttl_s=5, key=leader_key)
    stale = old.campaign()
    assert stale is not None
    refused: list[int] = []
    parts = JobParts.build(
        store,
        storage_root=tmp_path,
        secret=b"k" * 32,
        fence_source=lambda: stale,
        on_fence_refused=lambda: refused.append(1),
    )
    jobs = parts.records
    spec = {
        "name": "fenced",
        "model": {"name": "mlp"},
        "data": {"name": "synthetic"},
        "nodes": "1:3",
        "micro_batch_size": 4,
        "max_steps": 5,
    }
    record, created = jobs.create(parse_spec(spec))
    assert created and jobs.scale(record.id, 2).desired_nodes == 2 and refused == []

    store.lease_revoke(stale.lease_id)  # paused past its lease: etcd dropped the leader key
    new = LeaderElection(store, "new", ttl_s=5, key=leader_key)
    assert new.campaign() is not None
    writes = {
        "submit": lambda: jobs.create(parse_spec(spec | {"name": "again"})),
        "scale": lambda: jobs.scale(record.id, 3),
        "cancel": lambda: jobs.cancel(record.id),
        "heartbeat": lambda: parts.heartbeats.beat(record.id, "l0", 0, 5),
        "cleanup": lambda: parts.writes.commit([Write(f"{etcd_prefix}/j/", None, None, prefix=True)]),
    }
    for what, write in writes.items():
        with pytest.raises(NotLeaderError, match="etcd refused"):
            write()
        assert len(refused) >= 1, what
    after = jobs.get(record.id)
    assert after.desired_nodes == 2 and not after.cancel_requested
    assert [r.name for r in jobs.list()[0] if r.name == "again"] == []
    assert len(refused) == len(writes)

    leader = JobParts.build(
        store, storage_root=tmp_path, secret=b"k" * 32, fence_source=lambda: new.fence
    ).records
    assert leader.scale(record.id, 3).desired_nodes == 3


def test_a_standby_refuses_writes_before_sending_them(store: KVStore, tmp_path: Path) -> None:
    refused: list[int] = []
    jobs = JobParts.build(
        store,
        storage_root=tmp_path,
        secret=b"k" * 32,
        fence_source=lambda: None,
        on_fence_refused=lambda: refused.append(1),
    ).records
    with pytest.raises(NotLeaderError, match="not the leader"):
        jobs.create(
            parse_spec(
                {
                    "name": "x",
                    "model": {"name": "mlp"},
                    "data": {"name": "synthetic"},
                    "micro_batch_size": 4,
                    "max_steps": 5,
                }
            )
        )
    assert refused == []  # nothing reached the store


def test_prefix_delete_in_a_commit(store: KVStore, etcd_prefix: str) -> None:
    for key in ("a/1", "a/2", "ab"):
        store.put(f"{etcd_prefix}/{key}", b"v")
    assert store.commit([Write(f"{etcd_prefix}/a/", None, None, prefix=True)])
    assert [e.key for e in store.list_prefix(f"{etcd_prefix}/")] == [f"{etcd_prefix}/ab"]
    with pytest.raises(ValueError, match="prefix"):
        Write(f"{etcd_prefix}/a/", None, 0, prefix=True)


def test_etcd_leader_lease_expires_without_keep_alive(etcd_endpoint: str, etcd_prefix: str) -> None:
    store = EtcdStore(etcd_endpoint)
    key = f"{etcd_prefix}/leader"
    first = LeaderElection(store, "a", ttl_s=2, key=key)
    assert first.campaign() is not None
    second = LeaderElection(store, "b", ttl_s=2, key=key)
    deadline = time.monotonic() + 15
    while second.campaign() is None:
        assert time.monotonic() < deadline, "the lease never expired"
        time.sleep(0.5)
    assert not first.keep_alive()


def test_list_prefix_is_ordered_and_pages(store: KVStore, etcd_prefix: str) -> None:
    for i in (3, 1, 2):
        store.put(f"{etcd_prefix}/list/{i}", str(i).encode())
    store.put(f"{etcd_prefix}/listx", b"outside")
    keys = [e.key for e in store.list_prefix(f"{etcd_prefix}/list/")]
    assert keys == [f"{etcd_prefix}/list/{i}" for i in (1, 2, 3)]
    page = store.list_prefix(f"{etcd_prefix}/list/", limit=2)
    rest = store.list_prefix(f"{etcd_prefix}/list/", start_after=page[-1].key)
    assert [e.value for e in page + rest] == [b"1", b"2", b"3"]
    bare = store.list_prefix(f"{etcd_prefix}/list/", keys_only=True)  # keys and revisions, no value
    assert [(e.key, e.value, e.mod_revision) for e in bare] == [
        (e.key, b"", e.mod_revision) for e in page + rest
    ]
    upto = store.list_prefix(f"{etcd_prefix}/list/", last=f"{etcd_prefix}/list/2")  # 2 included
    assert [e.value for e in upto] == [b"1", b"2"]
    assert (
        store.list_prefix(f"{etcd_prefix}/list/", start_after=page[0].key, last=f"{etcd_prefix}/list/2")[
            0
        ].value
        == b"2"
    )
    assert [e.value for e in store.list_prefix(f"{etcd_prefix}/list/", last=f"{etcd_prefix}/lisz")] == [
        b"1", b"2", b"3",
    ]  # fmt: skip
    store.commit([Write(f"{etcd_prefix}/list/", None, None, prefix=True)])
    assert store.list_prefix(f"{etcd_prefix}/list/") == []
    assert store.get(f"{etcd_prefix}/listx") is not None


def test_unreachable_etcd_is_a_clear_error() -> None:
    store = EtcdStore("http://127.0.0.1:1", timeout_s=1)
    assert not store.healthy()
    with pytest.raises(EtcdUnavailableError, match="etcd is unreachable"):
        store.get("/x")


def test_memory_store_lease_expiry_with_a_clock() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    lease = store.lease_grant(5)
    store.put("/k", b"v", lease_id=lease)
    now[0] = 4.0
    assert store.lease_refresh(lease) and store.get("/k") is not None
    now[0] = 10.0
    assert store.get("/k") is None and not store.lease_refresh(lease)
