"""The leader's read-ahead of a planned re-formation (joiners waiting), off the training thread.

While joiners wait, the leader reads the generation record with its revision and the wished
size, and hosts the next generation's store, on a thread (:meth:`ReadAhead.ahead`); it asks the
group to re-form only once that is done, so the window boundary pays for the compare-and-set and
the announcement only. A recovery after a failure reads afresh (the hosted store is used by
whichever re-formation comes first).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.recovery.group import StoreHost
from worker.recovery.membership import KeyValueUnavailable, Membership
from worker.recovery.records import GenRecord, RecordError

AHEAD_FRESH_S = 2.0  # a read-ahead older than this is read again before a planned re-formation


@dataclass(frozen=True, slots=True)
class Ahead:
    """What the leader read ahead of a planned re-formation: the generation record with its
    revision, the wished size, and when the read started."""

    current: GenRecord | None
    revision: int
    desired: int | None
    at: float

    def usable(self, old: GenRecord | None, *, now: float) -> bool:
        """Fresh, and read while ``old`` was the current generation. Pure."""
        same = old is not None and self.current is not None and self.current.generation == old.generation
        return same and now - self.at < AHEAD_FRESH_S


class ReadAhead:
    """The newest read-ahead and the store hosted ahead, each taken once by a re-formation."""

    def __init__(
        self,
        *,
        advertise: str,
        store_timeout_s: float,
        membership: Membership,
        desired_world: Callable[[], int | None],
    ) -> None:
        self.advertise, self.store_timeout_s = advertise, store_timeout_s
        self.membership, self.desired_world = membership, desired_world
        self._ahead: Ahead | None = None
        self._reading: threading.Thread | None = None
        self._host: StoreHost | None = None  # the next generation's store, hosted ahead

    def ahead(self) -> Ahead | None:
        """The newest read-ahead while it is fresh; else None, and a new one starts on a thread
        (unless one runs)."""
        ahead = self._ahead
        if ahead is not None and time.time() - ahead.at < AHEAD_FRESH_S:
            return ahead
        if self._reading is None or not self._reading.is_alive():
            self._reading = threading.Thread(target=self._read, name="elastrain-read-ahead", daemon=True)
            self._reading.start()
        return None

    def _read(self) -> None:
        started = time.time()
        try:
            if self._host is None:
                self._host = StoreHost(self.advertise, timeout_s=self.store_timeout_s)
            current, revision = self.membership.generation()
        except (KeyValueUnavailable, RecordError, RuntimeError):
            return  # etcd away, or no port for the store: the next ballot asks again
        self._ahead = Ahead(current, revision, self.desired_world(), started)

    def take(self, old: GenRecord | None, *, planned: bool) -> Ahead | None:
        """The read-ahead, for a planned re-formation while it is usable; it is spent either way."""
        ahead, self._ahead = self._ahead, None
        return ahead if planned and ahead is not None and ahead.usable(old, now=time.time()) else None

    def take_host(self) -> StoreHost:
        """The store hosted ahead, else a new one."""
        host, self._host = self._host, None
        return host if host is not None else StoreHost(self.advertise, timeout_s=self.store_timeout_s)

    def close(self) -> None:
        """Stop serving a store hosted ahead and not used. Idempotent."""
        host, self._host = self._host, None
        if host is not None:
            host.close()
