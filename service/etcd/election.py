"""One leader at a time: the holder of ``LEADER_KEY`` on its own etcd lease, and the address it
publishes for the other instances (a standby forwards writes there)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from service.etcd.kv import LEADER_KEY, Fence, KVStore, Write

log = logging.getLogger("elastrain.election")


def address_key(leader_key: str = LEADER_KEY) -> str:
    """The key holding the leader's address, written with the leader key on the same lease (it
    goes when the leadership does)."""
    return f"{leader_key}-address"


def workers_address_key(leader_key: str = LEADER_KEY) -> str:
    """The key holding the leader's workers' listener address (``ELASTRAIN_WORKER_PORT``), on
    the same lease; absent when the leader serves workers on its API's port."""
    return f"{leader_key}-workers-address"


def leader_address(store: KVStore, leader_key: str = LEADER_KEY, *, workers: bool = False) -> str | None:
    """The address the current leader published (``workers``: its workers' listener's), or None
    (no leader, or it published none)."""
    found = store.get(workers_address_key(leader_key) if workers else address_key(leader_key))
    return found.value.decode() if found is not None and found.value else None


class LeaderElection:
    """One leader at a time: the holder of ``LEADER_KEY`` on its own lease.

    ``campaign()`` returns the :class:`Fence` to pass to every leader write, or None while
    another holder is alive. ``keep_alive()`` returns False once leadership is lost (the
    lease expired or the key changed); the caller must then stop acting as leader.
    """

    def __init__(
        self,
        store: KVStore,
        holder: str,
        *,
        ttl_s: int = 10,
        key: str = LEADER_KEY,
        address: str = "",
        workers_address: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self.holder = holder
        self.address = address
        """Where the other instances reach this one: published with the leader key, on its lease."""
        self.workers_address = workers_address
        """Where they reach its workers' listener (empty: it has none), published the same way."""
        self._ttl_s = ttl_s
        self._key = key
        self._clock = clock
        self._refreshed = float("-inf")
        self.fence: Fence | None = None

    @property
    def ttl_s(self) -> int:
        return self._ttl_s

    def campaign(self) -> Fence | None:
        """Held leadership is re-confirmed with etcd at most every ttl/3 (each confirmation is a
        lease refresh and a fenced read); a lease lost in between makes etcd refuse the writes."""
        if self.fence is not None and self._clock() - self._refreshed < self._ttl_s / 3:
            return self.fence
        if self.fence is not None and self.keep_alive():
            return self.fence
        current = self._store.get(self._key)
        if current is not None and current.value.decode() != self.holder:
            return None
        lease_id = self._store.lease_grant(self._ttl_s)
        expected = current.mod_revision if current is not None else 0
        writes = [Write(self._key, self.holder.encode(), expected, lease_id)]
        if self.address:
            writes.append(Write(address_key(self._key), self.address.encode(), None, lease_id))
        if self.workers_address:
            writes.append(
                Write(workers_address_key(self._key), self.workers_address.encode(), None, lease_id)
            )
        if self._store.commit(writes):
            self.fence = Fence(self.holder, lease_id, self._key)
            self._refreshed = self._clock()
            return self.fence
        self._store.lease_revoke(lease_id)
        return None

    def keep_alive(self) -> bool:
        fence = self.fence
        if fence is None:
            return False
        started = self._clock()
        held = self._store.lease_refresh(fence.lease_id) and self._store.commit([], fence=fence)
        if not held:
            # Said here, whichever caller found out (the keep-alive thread or a campaign): the
            # operator reads when this instance stopped leading.
            log.warning("leader lease lost: %s no longer leads", self.holder)
            self.fence = None
        else:
            self._refreshed = started
        return held

    def resign(self) -> None:
        """Give up leadership (idempotent): the next campaign of another holder wins at once."""
        fence, self.fence = self.fence, None
        if fence is not None:
            self._store.lease_revoke(fence.lease_id)
