"""Idle means idle: jobs waiting in the queue cost the reconciler's pass no etcd read of their
own. Reads are counted on the in-memory store the pass runs against (etcd's own cost per read is
the benchmark's business: ``benchmarks/queue_idle.py``)."""

from __future__ import annotations

from pathlib import Path

from service.checkpoints.adopt import StorageAdoption
from service.checkpoints.registry import Registry
from service.etcd.election import LeaderElection
from service.etcd.kv import Entry, Versioned
from service.etcd.memory import MemoryStore
from service.jobs.model import JobState
from service.jobs.parts import JobParts
from service.reconciler import ADOPT_EVERY_S, LaunchContext, Reconciler
from tests.specs import raw_spec
from tests.unit.service.svc_fakes import Clock, FakeScheduler
from worker.jobspec.spec import parse_spec


class CountingStore(MemoryStore):
    """The in-memory store, counting the reads a caller makes (a get or one range read each) and
    the bytes of the values they return."""

    reads = 0
    value_bytes = 0

    def get(self, key: str) -> Versioned | None:
        self.reads += 1
        found = super().get(key)
        self.value_bytes += len(found.value) if found is not None else 0
        return found

    def list_prefix(
        self,
        prefix: str,
        *,
        start_after: str | None = None,
        limit: int = 0,
        keys_only: bool = False,
        last: str | None = None,
    ) -> list[Entry]:
        self.reads += 1
        entries = super().list_prefix(
            prefix, start_after=start_after, limit=limit, keys_only=keys_only, last=last
        )
        self.value_bytes += sum(len(e.value) for e in entries)
        return entries


def reads_per_pass(tmp_path: Path, queued: int) -> tuple[int, int, int]:
    """One job training in the only slot and ``queued`` waiting: the reads of a pass, those of a
    pass that also reconciles the live jobs' checkpoints with storage, and the value bytes the
    first pass read."""
    clock = Clock()
    store = CountingStore(clock=clock)
    parts = JobParts.build(store, storage_root=tmp_path, secret=b"k" * 32, clock=clock)
    for name in ["training"] + [f"waits-{i}" for i in range(queued)]:
        parts.records.create(parse_spec(raw_spec(name, nodes="1")))
        clock.advance(0.001)
    election = LeaderElection(store, "a", ttl_s=10, clock=clock)
    storage = StorageAdoption(Registry(parts.records, clock=clock))
    r = Reconciler(
        parts, FakeScheduler(), election, launch=LaunchContext(service_url="http://s"), clock=clock,
        slots=1, storage=storage,
    )  # fmt: skip
    for _ in range(3):  # the first job launches and runs; the rest are QUEUED
        r.run_once()
        clock.advance(0.1)
    states = [stored.record.state for stored in parts.records.scan()]
    assert states.count(JobState.QUEUED) == queued and states.count(JobState.RUNNING) == 1
    store.reads = store.value_bytes = 0
    r.run_once()
    plain, plain_bytes = store.reads, store.value_bytes
    for _ in range(4):  # the same leadership term (a new one reconciles every job once)
        clock.advance(ADOPT_EVERY_S / 4)
        election.keep_alive()
    store.reads = 0
    r.run_once()
    return plain, store.reads, plain_bytes


def test_a_thousand_queued_jobs_cost_a_pass_no_read_and_no_value_of_their_own(tmp_path: Path) -> None:
    few = reads_per_pass(tmp_path / "few", queued=10)
    many = reads_per_pass(tmp_path / "many", queued=1000)
    # the listing of every job is one range read per 1,000 jobs: the one extra page, and no more
    assert many[0] <= few[0] + 1 and many[1] <= few[1] + 1, (few, many)
    assert many[2] == few[2], (few, many)  # and it reads keys and revisions: no queued job's value
