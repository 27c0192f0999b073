"""The newest training progress of each job: held by this instance, written to etcd at most
every ``flush_s`` per job (a worker reports every 2 s; each etcd write is a WAL fsync on the
machine that trains), each report while the job recovers or rescales, and when it ends; the
server batches these writes with the heartbeats' (:mod:`service.jobs.writebehind`). Reads see
the newest report, held or stored."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pydantic import ValidationError

from service.etcd.kv import FEW, read_all
from service.jobs import keys
from service.jobs.model import JobRecord, JobState, Progress
from service.jobs.writebehind import WriteBehind
from service.jobs.writes import LeaderWrites


@dataclass(frozen=True, slots=True)
class _Held:
    """The newest progress report of a job, whether it is in etcd, and when etcd last got one."""

    progress: Progress
    written: bool
    written_at: float


class ProgressBuffer:
    def __init__(
        self,
        writes: LeaderWrites,
        *,
        flush_s: float = 5.0,
        on_change: Callable[[str], None] = lambda job_id: None,
        clock: Callable[[], float] = time.time,
        behind: WriteBehind | None = None,
    ) -> None:
        self._writes = writes
        self._behind = behind if behind is not None else WriteBehind(writes)
        self._flush_s = flush_s
        self._on_change = on_change
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._this_term: set[str] = set()
        """Jobs that reported to this instance since its leadership term began: only the leader
        takes reports (a standby forwards them), so for these the held report is the newest."""

    def report(self, job: JobRecord, progress: Progress) -> None:
        """Take a worker's report; write it when due (see the module docstring)."""
        recovering = job.state in (JobState.RECOVERING, JobState.RESCALING)
        held = self._held.get(job.id)
        now = self._clock()
        if recovering or held is None or now - held.written_at >= self._flush_s:
            self._behind.put(keys.progress(job.id), progress.model_dump_json().encode())
            self._held[job.id] = _Held(progress, written=True, written_at=now)
        else:
            self._held[job.id] = _Held(progress, written=False, written_at=held.written_at)
        self._this_term.add(job.id)
        self._on_change(job.id)

    def new_term(self) -> None:
        """Leadership changed hands: reports held from before may be older than etcd's."""
        self._this_term = set()

    def in_hand(self, job_id: str) -> Progress | None:
        """The newest progress when it needs no read: the job reported since this leadership
        term began (None: ask :meth:`newest`). Only meaningful while this instance leads."""
        held = self._held.get(job_id) if job_id in self._this_term else None
        return held.progress if held is not None else None

    def newest(self, job_id: str, *, leading: bool = False) -> Progress | None:
        """The newest progress: etcd's, or the newer one this instance holds but has not written.
        ``leading``: this instance leads, so a report taken in this term is the newest (no read:
        :meth:`in_hand`)."""
        if leading and (held := self.in_hand(job_id)) is not None:
            return held
        found = self._writes.store.get(keys.progress(job_id))
        return self._newer(job_id, _decode(found.value) if found else None)

    def newest_of(self, job_ids: Collection[str]) -> dict[str, Progress | None]:
        """:meth:`newest` of each of ``job_ids``: a read each for a few, else one range read from
        the first id's key to the last's (a pass reads them once, not once a job; a page of jobs
        reads the page's range, not every job's); only theirs are decoded."""
        if len(job_ids) <= FEW:
            return {job_id: self.newest(job_id) for job_id in job_ids}
        wanted = set(job_ids)
        stored: dict[str, Progress | None] = {}
        first, last = keys.progress(min(wanted)), keys.progress(max(wanted))
        for entry in read_all(self._writes.store, keys.PROGRESS, first=first, last=last):
            job_id = entry.key[len(keys.PROGRESS) :]
            if job_id in wanted:
                stored[job_id] = _decode(entry.value)
        return {job_id: self._newer(job_id, stored.get(job_id)) for job_id in job_ids}

    def _newer(self, job_id: str, stored: Progress | None) -> Progress | None:
        held = self._held.get(job_id)
        if held is not None and (stored is None or held.progress.time > stored.time):
            return held.progress
        return stored

    def flush(self, job_id: str) -> None:
        """Write the newest held progress if etcd lacks it, and forget it (the job finished)."""
        held = self._held.pop(job_id, None)
        if held is not None and not held.written:
            self._behind.put(keys.progress(job_id), held.progress.model_dump_json().encode())
        self._behind.flush()


def _decode(raw: bytes) -> Progress | None:
    """A stored progress report; one that cannot be read counts as none (the next report
    replaces it) rather than failing every read of the job."""
    try:
        return Progress.model_validate_json(raw)
    except ValidationError:
        return None
