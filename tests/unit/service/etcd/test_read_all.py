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


def test_read_all_between_two_keys_includes_both_whether_or_not_they_exist() -> None:
    store = MemoryStore()
    for i in range(0, 10, 2):
        store.put(f"/a/{i:02d}", str(i).encode())
    for page in (1, 2, 100):
        assert [e.key for e in read_all(store, "/a/", page=page, first="/a/02", last="/a/06")] == [
            "/a/02", "/a/04", "/a/06",
        ]  # fmt: skip
        assert [e.key for e in read_all(store, "/a/", page=page, first="/a/03", last="/a/07")] == [
            "/a/04", "/a/06",
        ]  # fmt: skip
        only = read_all(store, "/a/", page=page, first="/a/08", last="/a/08", keys_only=True)
        assert [(e.key, e.value) for e in only] == [("/a/08", b"")]
