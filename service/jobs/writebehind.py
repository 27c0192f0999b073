"""Last-writer-wins values (heartbeats, progress) written to etcd together.

Every running rank beats every few seconds and every job's rank 0 reports progress every two:
with many jobs, one etcd transaction per value is most of what etcd and the service do (each is
a request, a Raft entry, a revision and a WAL fsync). A :class:`WriteBehind` with a ``delay_s``
takes the value into memory and writes what gathered within ``delay_s`` of the first in one
fenced transaction per ``MAX_OPS`` keys, the newest value of each key only. The leader's lease
still fences every transaction; a standby refuses the value at once (:class:`NotLeaderError`,
the caller's 503), as a write would. A batch that etcd refuses or cannot take is dropped with a
log line and a metric: these values are superseded by the next beat or report anyway, and
readers on this instance see the values it holds (see :mod:`service.jobs.heartbeats` and
:mod:`service.jobs.progress`). Without a ``delay_s`` every value is written at once (tests,
offline tools).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from service.etcd.kv import Write
from service.jobs.errors import NotLeaderError
from service.jobs.writes import LeaderWrites
from worker.etcdclient import EtcdUnavailableError

log = logging.getLogger("elastrain.writebehind")

MAX_OPS = 100
"""Keys per transaction: below etcd's default ``--max-txn-ops`` (128)."""


class WriteBehind:
    def __init__(
        self,
        writes: LeaderWrites,
        *,
        delay_s: float | None = None,
        on_dropped: Callable[[int], None] = lambda count: None,
    ) -> None:
        self._writes = writes
        self._delay_s = delay_s
        self._on_dropped = on_dropped
        """Hears how many values a refused or failed batch dropped."""
        self._pending: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        """One flush at a time: a key's values reach etcd in the order they were taken."""
        self._due = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def deferred(self) -> bool:
        """Whether values wait for a batch (else each is written at once)."""
        return self._delay_s is not None

    def put(self, key: str, value: bytes) -> None:
        """Write ``value`` within ``delay_s`` (at once without one). NotLeaderError on a standby."""
        if self._delay_s is None:
            self._writes.put(key, value)
            return
        self._writes.fence()  # a standby refuses now, not in the batch
        with self._lock:
            self._pending[key] = value
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="write-behind", daemon=True)
                self._thread.start()
        self._due.set()

    def drop(self, prefix: str) -> None:
        """Forget the values not yet written under ``prefix`` (their job ended)."""
        with self._lock:
            for key in [k for k in self._pending if k.startswith(prefix)]:
                del self._pending[key]

    def flush(self) -> int:
        """Write every value held now, ``MAX_OPS`` keys a transaction; returns how many were
        written. Values of a refused or failed transaction are dropped (see the module)."""
        with self._flushing:
            with self._lock:
                pending, self._pending = self._pending, {}
            batch = [Write(key, value, None) for key, value in pending.items()]
            for start in range(0, len(batch), MAX_OPS):
                try:
                    self._writes.commit(batch[start : start + MAX_OPS])
                except (NotLeaderError, EtcdUnavailableError) as exc:
                    log.warning("dropped %d heartbeats and progress reports: %s", len(batch) - start, exc)
                    self._on_dropped(len(batch) - start)
                    return start
            return len(batch)

    def _run(self) -> None:
        assert self._delay_s is not None
        while True:
            self._due.wait()
            time.sleep(self._delay_s)  # let the batch gather
            self._due.clear()
            try:
                self.flush()
            except Exception:  # never let the writer die: the next batch tries again
                log.exception("writing heartbeats and progress reports failed")
