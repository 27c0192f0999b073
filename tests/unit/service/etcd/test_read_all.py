"""read_all: every key under a prefix, page after page, and nothing beyond it."""

from __future__ import annotations

from service.etcd.kv import Entry, read_all
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


class CountingStore(MemoryStore):
    """Counts the entries its range reads answer with (what etcd would send)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0

    def list_prefix(self, prefix: str, **kwargs: object) -> list[Entry]:
        entries = super().list_prefix(prefix, **kwargs)  # type: ignore[arg-type]
        self.sent += len(entries)
        return entries


def test_a_bounded_read_asks_for_no_key_past_the_last() -> None:
    """A page of jobs reads its own jobs' keys, not every key after its first one."""
    store = CountingStore()
    for i in range(100):
        store.put(f"/a/{i:03d}", b"x" * 100)
    for page in (7, 1000):
        store.sent = 0
        entries = read_all(store, "/a/", page=page, first="/a/010", last="/a/019")
        assert [e.key for e in entries] == [f"/a/{i:03d}" for i in range(10, 20)]
        assert store.sent <= 9 + 1  # the keys after the first one, and a page that ends at the last
    assert [e.key for e in store.list_prefix("/a/", last="/a/001")] == ["/a/000", "/a/001"]
    assert store.list_prefix("/a/", start_after="/a/050", last="/a/020") == []
