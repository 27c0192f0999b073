"""A run's events in its bucket, for ``elastrain report`` of a job whose checkpoints are on S3.

On a local directory rank 0 appends every event line to ``events.jsonl`` in the run directory.
An object cannot be appended to, so on ``s3://BUCKET/PREFIX`` each process that would write that
file keeps its own lines of this attempt and writes them whole, in the background, as one
object::

    s3://BUCKET/PREFIX/events/<start ms>-<host>-<pid>.jsonl

The copy is rewritten after each event in :data:`UPLOAD_AFTER` and after any event once
:data:`EVERY_S` has passed since the last write; after a checkpoint's publish and after
``finished`` the caller waits until the write was tried (:data:`WAIT_AFTER`, a bound: a store
that does not answer delays training by that much at most). A process killed at once loses the
lines since its last write: at most :data:`EVERY_S` of them, never those up to the newest
published checkpoint. A store that fails a write is said once on stderr and tried again at the
next trigger. ``events/`` is no step prefix, so nothing that reads the steps sees these objects.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from worker.jobspec.location import S3Location

EVENTS_PREFIX = "events"
UPLOAD_AFTER = frozenset(
    {
        "checkpoint_published",
        "checkpoint_aborted",
        "resumed",
        "checkpoint_restored",
        "group_formed",
        "finished",
    }
)
EVERY_S = 30.0
#: The events after which the caller waits (seconds at most) until the copy was written.
WAIT_AFTER = {"checkpoint_published": 10.0, "finished": 30.0}


def events_object(job: S3Location, started: float, host: str, pid: int) -> S3Location:
    """Where a process started at ``started`` keeps its events: names sort by start time. Pure."""
    safe = re.sub(r"[^A-Za-z0-9.-]", "_", host)[:64] or "host"
    return job / EVENTS_PREFIX / f"{int(started * 1000):013d}-{safe}-{pid}.jsonl"


def upload_due(event: str, last_write: float, now: float) -> bool:
    """Whether ``event`` at ``now`` calls for a new write of the copy. Pure."""
    return event in UPLOAD_AFTER or now - last_write >= EVERY_S


class BucketEvents:
    """The lines of one process, written whole to ``target`` by a background thread (see the
    module). ``write(key, data)`` is the store's (:meth:`worker.checkpoint.storage.S3Storage.write`)."""

    def __init__(self, target: S3Location, write: Callable[[str, bytes], object]) -> None:
        self.target = target
        self._write = write
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._written = threading.Condition(self._lock)
        self._tried = 0  # lines the last write carried, whether it succeeded or not
        self._last = time.monotonic()
        self._failed = False
        threading.Thread(target=self._loop, name="elastrain-bucket-events", daemon=True).start()

    def __call__(self, event: str, line: str) -> None:
        """Take one event line (an :class:`~worker.report.events.Events` line copy)."""
        with self._lock:
            self._lines.append(line)
            want = len(self._lines)
        if upload_due(event, self._last, time.monotonic()):
            self._wake.set()
            if event in WAIT_AFTER:
                self.wait(want, WAIT_AFTER[event])

    def wait(self, lines: int, timeout_s: float) -> None:
        """Wait until a write of the first ``lines`` lines was tried (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        with self._written:
            while self._tried < lines and (left := deadline - time.monotonic()) > 0:
                self._written.wait(left)

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                data, count = "".join(self._lines).encode(), len(self._lines)
            self._last = time.monotonic()
            try:
                self._write(self.target.prefix, data)
            except Exception as exc:  # a store's failure must not end training
                if not self._failed:
                    self._failed = True
                    sys.stderr.write(f"elastrain worker: events not written to {self.target}: {exc}\n")
            with self._written:
                self._tried = max(self._tried, count)
                self._written.notify_all()


def read_run(job: S3Location) -> tuple[list[str], list[dict[str, Any]]]:
    """What ``elastrain report`` reads of a job on S3: the event lines of every process's copy
    (in the order the processes started) and the manifests of the published steps, oldest
    first. Raises :class:`~worker.checkpoint.storage.StorageError`."""
    from worker.checkpoint.manifest import MANIFEST_NAME
    from worker.checkpoint.remote import list_published
    from worker.checkpoint.storage import storage_for

    store = storage_for(job)
    _, objects = store.listing((job / EVENTS_PREFIX).prefix)
    lines = []
    for o in sorted(objects, key=lambda o: o.key):
        if o.key.endswith(".jsonl"):
            lines.extend(store.read(o.key).decode("utf-8", "replace").splitlines())
    manifests = []
    for _, step in list_published(job):
        try:
            manifests.append(json.loads(store.read(step.key(MANIFEST_NAME))))
        except ValueError:
            continue
    return lines, manifests
