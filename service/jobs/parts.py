"""The job duties of one service instance, built together, complete, on one state store: the
fenced writes, the records, the held progress, the heartbeats, and the rendered views of jobs
that every write of this instance drops."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from service.etcd.kv import Fence, KVStore
from service.jobs.budget import WorkerBudget
from service.jobs.cache import TTLCache
from service.jobs.events import WINDOW_S
from service.jobs.heartbeats import Heartbeats
from service.jobs.objectstore import ObjectStorage
from service.jobs.progress import ProgressBuffer
from service.jobs.service import JobService
from service.jobs.writebehind import WriteBehind
from service.jobs.writes import LeaderWrites

VIEW_CACHE_S = 0.5
"""How long a rendered ``GET /v1/jobs/{id}`` answer may be served (this instance's writes drop
it at once; another instance's show within this)."""


@dataclass(frozen=True, slots=True)
class JobParts:
    writes: LeaderWrites
    records: JobService
    progress: ProgressBuffer
    heartbeats: Heartbeats
    views: TTLCache[bytes]
    """Rendered ``GET /v1/jobs/{id}`` bodies; dropped on every write this instance makes."""
    budget: WorkerBudget
    """What each job's workers may still send (requests and bytes)."""

    @classmethod
    def build(
        cls,
        store: KVStore,
        *,
        storage_root: Path,
        secret: bytes,
        fence_source: Callable[[], Fence | None] | None = None,
        on_fence_refused: Callable[[], None] = lambda: None,
        on_job_write: Callable[[str], None] = lambda job_id: None,
        heartbeat_write_s: float = 15.0,
        progress_flush_s: float = 5.0,
        merge_window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.time,
        object_storage: ObjectStorage | None = None,
        write_behind_s: float | None = None,
        on_write_dropped: Callable[[int], None] = lambda count: None,
    ) -> JobParts:
        """``fence_source``: this instance's leader fence (None while it does not lead; leave it
        out for unfenced writes); ``on_job_write``: hears of every write of a job record (the
        server wakes the reconciler); ``merge_window_s``: how long a completed incident takes
        late reports of it (two heartbeat timeouts); ``object_storage``: the service's access to
        S3 (None: a job's ``s3://`` location is refused at submit); ``write_behind_s``: heartbeats
        and progress gather this long and go to etcd together (None: each at once; see
        :mod:`service.jobs.writebehind`), ``on_write_dropped`` hears how many a failed batch lost."""
        views = TTLCache[bytes](VIEW_CACHE_S)
        writes = LeaderWrites(store, fence_source=fence_source, on_refused=on_fence_refused)
        behind = WriteBehind(writes, delay_s=write_behind_s, on_dropped=on_write_dropped)
        progress = ProgressBuffer(
            writes, flush_s=progress_flush_s, on_change=views.drop, clock=clock, behind=behind
        )
        heartbeats = Heartbeats(writes, write_every_s=heartbeat_write_s, clock=clock, behind=behind)
        records = JobService(
            writes,
            storage_root=storage_root,
            secret=secret,
            progress=progress,
            heartbeats=heartbeats,
            clock=clock,
            on_change=views.drop,
            on_job_write=on_job_write,
            merge_window_s=merge_window_s,
            object_storage=object_storage,
        )
        return cls(
            writes=writes,
            records=records,
            progress=progress,
            heartbeats=heartbeats,
            views=views,
            budget=WorkerBudget(),
        )
