"""read_all: every key under a prefix, page after page, and nothing beyond it."""

from __future__ import annotations

from service.etcd.kv import read_all
from service.etcd.memory import MemoryStore


def test_read_all_pages_through_every_key_under_the_prefix_only() -> None:
    store = MemoryStore()
    for i in range(7):
        store.put(f"/a/{i:02d}", str(i).encode())
    store.put("/ab", b"beside")
    store.put("/b/0", b"after")
    for page in (1, 3, 7, 100):
        entries = read_all(store, "/a/", page=page)
        assert [e.key for e in entries] == [f"/a/{i:02d}" for i in range(7)]
        assert [e.value for e in entries] == [str(i).encode() for i in range(7)]
    assert read_all(store, "/none/") == []
