"""Every state write of this service instance, fenced by its leadership.

With a ``fence_source`` (the server wires the leader election's), every write -- a new job, a
scale, a cancel, a worker's event, heartbeat or progress, the checkpoint claims and registry --
goes to etcd in one transaction that also compares the leader key with this instance's holder
id and lease. A leader that was paused past its lease (another instance leads now) has its
writes refused by etcd itself, not by its own possibly stale view; a standby refuses writes
before sending them. Both raise :class:`~service.jobs.errors.NotLeaderError` (HTTP 503, retry).
Without a ``fence_source`` (unit tests, offline tools) writes are plain compare-and-set.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from service.etcd.kv import Fence, KVStore, Write
from service.jobs.errors import NotLeaderError


class LeaderWrites:
    def __init__(
        self,
        store: KVStore,
        *,
        fence_source: Callable[[], Fence | None] | None = None,
        on_refused: Callable[[], None] = lambda: None,
    ) -> None:
        self.store = store
        """For reads (which need no fence)."""
        self._fence_source = fence_source
        self._on_refused = on_refused
        """Called when etcd refused a write because the fence no longer holds (a stale leader)."""

    def fence(self) -> Fence | None:
        """The fence every write must carry; raises NotLeaderError on a standby instance."""
        if self._fence_source is None:
            return None
        fence = self._fence_source()
        if fence is None:
            raise NotLeaderError(
                "this service instance is not the leader (another instance holds the etcd lease, or "
                "leadership is being taken over after a restart); send writes to the leader"
            )
        return fence

    def commit(self, writes: Sequence[Write], *, fence: Fence | None = None) -> bool:
        """Apply ``writes`` atomically, fenced by ``fence`` (default: :meth:`fence`). False when a
        compare-and-set lost a race; NotLeaderError when etcd refused the fence."""
        fence = fence if fence is not None else self.fence()
        if self.store.commit(writes, fence=fence):
            return True
        if fence is not None and not self.store.commit([], fence=fence):
            self._on_refused()
            raise NotLeaderError("this service is no longer the leader; etcd refused its write (fenced)")
        return False

    def put(self, key: str, value: bytes) -> None:
        """A last-writer-wins write (no revision condition), still fenced."""
        self.commit([Write(key, value, None)])
