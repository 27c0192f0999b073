"""A record is decoded once per stored revision: a read of an unchanged record reuses it, a
written one is decoded again, and an unreadable one is never reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.etcd.memory import MemoryStore
from service.jobs import keys
from service.jobs.cache import RevisionCache
from service.jobs.model import JobRecord, JobState
from service.jobs.parts import JobParts
from tests.specs import raw_spec
from worker.jobspec.spec import parse_spec


def test_a_revision_cache_answers_only_for_the_revision_it_holds() -> None:
    cache = RevisionCache[str](max_entries=2)
    cache.put("a", 5, "five")
    assert cache.get("a", 5) == "five"
    assert cache.get("a", 6) is None and cache.get("b", 5) is None
    cache.put("a", 6, "six")
    assert cache.get("a", 5) is None and cache.get("a", 6) == "six"
    cache.put("b", 1, "one")
    cache.put("c", 1, "one")  # past max_entries: starts over
    assert cache.get("a", 6) is None and cache.get("c", 1) == "one"


def test_scans_decode_a_record_once_per_revision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    parts = JobParts.build(store, storage_root=tmp_path, secret=b"k" * 32)
    first = parts.records.create(parse_spec(raw_spec("a", micro_batch_size=4)))[0].id
    parts.records.create(parse_spec(raw_spec("b", micro_batch_size=4)))
    decoded: list[bytes] = []
    real = JobRecord.from_json

    def counting(raw: bytes | str) -> JobRecord:
        decoded.append(raw if isinstance(raw, bytes) else raw.encode())
        return real(raw)

    monkeypatch.setattr(JobRecord, "from_json", staticmethod(counting))
    once = parts.records.scan()
    assert parts.records.scan() == once  # the same records, revisions and all
    assert len(decoded) <= 2  # at most what the creates had not decoded yet
    before = len(decoded)
    parts.records.cancel(first)  # a new revision of one record
    after = {s.record.id: s.record for s in parts.records.scan()}
    assert after[first] == parts.records.get(first) != next(s.record for s in once if s.record.id == first)
    assert len(decoded) == before + 1


def test_an_unreadable_record_is_read_again_each_time(tmp_path: Path) -> None:
    store = MemoryStore()
    parts = JobParts.build(store, storage_root=tmp_path, secret=b"k" * 32)
    store.put(keys.job("broken-1"), b"{not json")
    for _ in range(2):
        (stored,) = parts.records.scan()
        assert stored.unreadable is not None and stored.record.state == JobState.FAILED
