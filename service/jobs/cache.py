"""Caches for hot reads: rendered ``GET /v1/jobs/{id}`` bodies and the records the workers'
callbacks check.

Entries live ``ttl_s`` seconds; the service drops an entry as soon as it writes the job itself,
so a client reads its own writes, and changes made by another instance show within ``ttl_s``. A
value read while its key was written is not kept (:meth:`TTLCache.stamp`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class TTLCache(Generic[V]):
    def __init__(
        self, ttl_s: float, *, max_entries: int = 10_000, clock: Callable[[], float] = time.monotonic
    ):
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._data: dict[str, tuple[float, V]] = {}
        self._lock = threading.Lock()
        self._generation = 0
        self._dropped: dict[str, int] = {}
        """Per key, the generation of its latest drop (pruned past ``max_entries``: then every
        stamp taken before the prune is refused)."""
        self._floor = 0

    def get(self, key: str) -> V | None:
        item = self._data.get(key)
        if item is None or item[0] < self._clock():
            return None
        return item[1]

    def stamp(self) -> int:
        """Take before reading what :meth:`put` will store: a put with it is refused when the key
        was dropped (or the cache cleared) since, so a read that raced a write never stores the
        value the write replaced."""
        return self._generation

    def put(self, key: str, value: V, *, stamp: int | None = None) -> None:
        with self._lock:
            if stamp is not None and (stamp < self._floor or self._dropped.get(key, -1) > stamp):
                return
            if len(self._data) >= self.max_entries:
                now = self._clock()
                self._data = {k: v for k, v in self._data.items() if v[0] >= now}
                if len(self._data) >= self.max_entries:
                    self._data.clear()
            self._data[key] = (self._clock() + self.ttl_s, value)

    def drop(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)
            self._generation += 1
            self._dropped[key] = self._generation
            if len(self._dropped) > self.max_entries:
                self._dropped.clear()
                self._floor = self._generation

    def clear(self) -> None:
        """Drop every entry (and refuse every put stamped before now)."""
        with self._lock:
            self._data.clear()
            self._dropped.clear()
            self._generation += 1
            self._floor = self._generation


class RevisionCache(Generic[V]):
    """Values decoded from etcd, per key, valid for exactly the mod_revision they were decoded
    from: a read that finds the same revision reuses the value (nothing to decode), any other
    revision misses. Keeps at most ``max_entries`` (past that it starts over). Thread-safe."""

    def __init__(self, *, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._data: dict[str, tuple[int, V]] = {}
        self._lock = threading.Lock()

    def get(self, key: str, revision: int) -> V | None:
        item = self._data.get(key)
        return item[1] if item is not None and item[0] == revision else None

    def put(self, key: str, revision: int, value: V) -> None:
        with self._lock:
            if len(self._data) >= self.max_entries and key not in self._data:
                self._data.clear()
            self._data[key] = (revision, value)
