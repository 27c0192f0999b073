"""A leader's read-ahead of a planned re-formation (worker.recovery.readahead.Ahead): used only
while it is fresh and was read while the generation being re-formed was the current one; else
the re-formation reads etcd itself, as a recovery after a failure always does."""

from __future__ import annotations

from worker.recovery.readahead import AHEAD_FRESH_S, Ahead
from worker.recovery.records import GenRecord


def record(generation: int) -> GenRecord:
    return GenRecord(generation, ("a", "b"), ("h:a", "h:b"), "a", "h:a", "h:s", 2)


def test_a_fresh_read_of_the_same_generation_is_used() -> None:
    ahead = Ahead(record(4), revision=17, desired=3, at=100.0)
    assert ahead.usable(record(4), now=100.0 + AHEAD_FRESH_S / 2)


def test_a_stale_or_foreign_read_is_not() -> None:
    ahead = Ahead(record(4), revision=17, desired=3, at=100.0)
    assert not ahead.usable(record(4), now=100.0 + AHEAD_FRESH_S), "too old: read again"
    assert not ahead.usable(record(5), now=100.5), "read before the generation being re-formed"
    assert not ahead.usable(None, now=100.5), "a first generation has nothing read ahead"
    assert not Ahead(None, revision=0, desired=None, at=100.0).usable(record(4), now=100.5)
