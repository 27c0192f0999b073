"""The service's garbage-collection policy: the heap it starts with is never walked again, and
young collections are rare (a full collection walking the leader's records held the interpreter
for about a tenth of a second every few seconds)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from service.server import YOUNG_COLLECTION_AFTER, collect_less


@pytest.fixture
def restored() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_the_started_heap_is_frozen_and_young_collections_are_rare(restored: None) -> None:
    gc.unfreeze()
    kept = [[] for _ in range(1000)]  # objects the service holds once it is built
    collect_less()
    assert gc.get_freeze_count() >= len(kept)  # out of every collection from now on
    young, middle, old = gc.get_threshold()
    assert young == YOUNG_COLLECTION_AFTER and young > 10 * 700 and middle >= 10 and old >= 10
    cycle: list[object] = []
    cycle.append(cycle)
    del cycle
    assert gc.collect() >= 1  # cycles made after the freeze are still collected
