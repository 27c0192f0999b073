"""The records the leader holds for its workers' callbacks: a read that raced a write of the job
is never kept, and a leadership term starts with nothing held, so a record held for as long as
the instance leads is never one another leader replaced."""

from __future__ import annotations

from pathlib import Path

from service.jobs import keys
from service.jobs.cache import TTLCache
from service.jobs.model import JobState
from tests.unit.service.reconciler.test_reconciler import World


def test_a_put_stamped_before_a_drop_or_a_clear_is_refused() -> None:
    cache = TTLCache[str](60.0)
    stamp = cache.stamp()
    cache.drop("a")  # a write landed while the value was being read
    cache.put("a", "old", stamp=stamp)
    assert cache.get("a") is None
    cache.put("b", "read before no drop of b", stamp=stamp)
    assert cache.get("b") == "read before no drop of b"
    fresh = cache.stamp()
    cache.put("a", "new", stamp=fresh)
    assert cache.get("a") == "new"
    cache.clear()
    assert cache.get("a") is None and cache.get("b") is None
    cache.put("a", "read before the clear", stamp=fresh)
    assert cache.get("a") is None


def test_pruned_drops_still_refuse_older_stamps() -> None:
    cache = TTLCache[str](60.0, max_entries=2)
    stamp = cache.stamp()
    for key in ("a", "b", "c"):  # past max_entries: the per-key drops are forgotten
        cache.drop(key)
    cache.put("a", "stale", stamp=stamp)
    assert cache.get("a") is None


class RacingStore:
    """The store, where a write of the job lands between the read's request and its answer."""

    def __init__(self, world: World, job_id: str) -> None:
        self.world, self.job_id, self.inner = world, job_id, world.store
        self.raced = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def get(self, key: str) -> object:
        found = self.inner.get(key)
        if self.raced:
            return found
        self.raced = True
        self.world.jobs.update(self.job_id, lambda r: r.model_copy(update={"cancel_requested": True}))
        return found


def test_a_read_that_raced_a_write_is_answered_but_not_held(tmp_path: Path) -> None:
    world = World(tmp_path)
    job_id = world.submit(nodes="1")
    writes = world.jobs.writes
    racing = RacingStore(world, job_id)
    store, writes.store = writes.store, racing  # type: ignore[assignment]
    try:
        raced = world.jobs.get_recent(job_id)
    finally:
        writes.store = store
    assert not raced.cancel_requested  # what etcd held when it was read
    assert world.jobs.cached_recent(job_id) is None
    assert world.jobs.get_recent(job_id).cancel_requested


def test_a_new_term_reads_again_what_another_leader_may_have_written(tmp_path: Path) -> None:
    world = World(tmp_path)
    job_id = world.submit(nodes="1")
    first = world.reconciler("first")
    assert first.run_once() and first.run_once()
    assert world.jobs.get_recent(job_id).state == JobState.RUNNING  # steady: no pass writes it
    # Another instance leads for a while and writes the job (this one is not told) ...
    changed = world.jobs.get(job_id).model_copy(update={"worker_token_hash": "0" * 64})
    world.store.put(keys.job(job_id), changed.to_json())
    assert world.jobs.get_recent(job_id).worker_token_hash != "0" * 64  # held, as while it led
    world.clock.advance(30)  # ... and this instance's lease ran out meanwhile
    second = world.reconciler("second")
    revision = world.store.get(keys.job(job_id)).mod_revision
    assert second.run_once()  # a new term
    assert world.store.get(keys.job(job_id)).mod_revision == revision  # it wrote nothing
    assert world.jobs.get_recent(job_id).worker_token_hash == "0" * 64
