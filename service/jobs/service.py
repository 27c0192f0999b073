"""Jobs on the state store: create (idempotent), read, list, change with compare-and-set.

Synchronous on purpose (etcd3gw is sync); the API calls it from a thread pool. Every change is
``update(job_id, change)``: read the record and its mod_revision, apply a pure ``change``, write
it back only if the revision is unchanged, retry on a lost race. Errors are
:class:`ElastrainError` subclasses the API maps to HTTP statuses.

Fencing: with a ``fence_source`` (the server wires the leader election's), every write -- a new
job, a scale, a cancel, a worker's event, heartbeat or progress, the coordinator's claims and
registry -- goes to etcd in one transaction that also compares the leader key with this
instance's holder id and lease. A leader that was paused past its lease (another instance leads
now) has its writes refused by etcd itself, not by its own possibly stale view; a standby
instance refuses writes before sending them. Both answer :class:`NotLeaderError` (HTTP 503,
retry). Without a ``fence_source`` (unit tests, offline tools) writes are plain compare-and-set.
"""

from __future__ import annotations

import builtins
import hashlib
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from service.etcd.kv import Fence, KVStore, Write
from service.jobs import keys
from service.jobs.events import WorkerEvent, apply_worker_event, first_step_done, merge_progress
from service.jobs.machine import request_cancel, request_scale
from service.jobs.model import JobRecord, JobState, Progress
from service.jobs.paths import checkpoint_dir, resume_source
from service.jobs.tokens import derive_worker_token, hash_token
from worker.errors import ElastrainError
from worker.failpoints import failpoint
from worker.spec import JobSpec, parse_nodes, spec_json


class NotFoundError(ElastrainError):
    """No such job (or checkpoint)."""


class ConflictError(ElastrainError):
    """The request contradicts stored state (e.g. an idempotency key reused for another spec)."""


class InvalidRequestError(ElastrainError):
    """A well-formed request whose content the service cannot accept (422)."""


class NotLeaderError(ElastrainError):
    """This service instance lost leadership; its fenced write was refused."""


@dataclass(frozen=True, slots=True)
class _HeldProgress:
    """The newest progress report of a job, whether it is in etcd, and when etcd last got one."""

    progress: Progress
    written: bool
    written_at: float


def ensure_worker_secret(store: KVStore) -> bytes:
    """The service-wide secret worker tokens derive from, created once (first writer wins)."""
    for _ in range(5):
        found = store.get(keys.WORKER_SECRET)
        if found is not None:
            return bytes.fromhex(found.value.decode())
        store.commit([Write(keys.WORKER_SECRET, secrets.token_hex(32).encode(), 0)])
    raise ConflictError("could not create or read the worker secret in etcd; check etcd health")


def valid_job_id(job_id: str) -> bool:
    return bool(keys.JOB_ID_RE.match(job_id))


@dataclass
class JobService:
    store: KVStore
    storage_root: Path
    secret: bytes
    clock: Callable[[], float] = field(default=time.time)
    on_change: Callable[[str], None] = field(default=lambda job_id: None)
    """Called with the job id after every write to a job or its progress (cache invalidation)."""
    on_job_write: Callable[[str], None] = field(default=lambda job_id: None)
    """Called with the job id after a write of the job record itself (wakes the reconciler)."""
    fence_source: Callable[[], Fence | None] | None = None
    """This instance's current leader fence (None while it does not lead); None: writes unfenced."""
    on_fence_refused: Callable[[], None] = field(default=lambda: None)
    """Called when etcd refused a write because the fence no longer holds (a stale leader)."""
    progress_flush_s: float = 5.0
    """A worker's progress (every 2 s) reaches etcd at most this often per job; this
    instance answers from the newest report it holds. Progress during a recovery goes at once."""
    heartbeat_write_s: float = 15.0
    """A rank's heartbeat (every few seconds) reaches etcd at most this often; the server sets a
    quarter of the reconciler's heartbeat timeout, so a live rank is never seen as silent."""
    record_cache_s: float = 2.0
    """How long :meth:`get_recent` may answer a job record from memory (this instance's own
    writes replace it at once; only the leader writes, so it is stale only across a failover)."""
    _recent: dict[str, tuple[float, JobRecord]] = field(default_factory=dict, init=False, repr=False)
    _progress: dict[str, _HeldProgress] = field(default_factory=dict, init=False, repr=False)
    _beats_written: dict[str, float] = field(default_factory=dict, init=False, repr=False)
    _beats_pruned_at: float = field(default=-math.inf, init=False, repr=False)

    # ------------------------------------------------------------------ fencing

    def fence(self) -> Fence | None:
        """The fence every write must carry; raises NotLeaderError on a standby instance."""
        if self.fence_source is None:
            return None
        fence = self.fence_source()
        if fence is None:
            raise NotLeaderError(
                "this service instance is not the leader (another instance holds the etcd lease, or "
                "leadership is being taken over after a restart); send writes to the leader"
            )
        return fence

    def commit(self, writes: list[Write], *, fence: Fence | None = None) -> bool:
        """Apply ``writes`` atomically, fenced by ``fence`` (default: :meth:`fence`). False when a
        compare-and-set lost a race; NotLeaderError when etcd refused the fence."""
        fence = fence if fence is not None else self.fence()
        if self.store.commit(writes, fence=fence):
            return True
        if fence is not None and not self.store.commit([], fence=fence):
            self.on_fence_refused()
            raise NotLeaderError("this service is no longer the leader; etcd refused its write (fenced)")
        return False

    def put(self, key: str, value: bytes) -> None:
        """A last-writer-wins write (no revision condition), still fenced."""
        self.commit([Write(key, value, None)])

    # ------------------------------------------------------------------ reads

    def get_versioned(self, job_id: str) -> tuple[JobRecord, int]:
        found = self.store.get(keys.job(job_id)) if valid_job_id(job_id) else None
        if found is None:
            raise NotFoundError(f"no job {job_id!r}; list jobs with GET /v1/jobs or `elastrain jobs`")
        return JobRecord.from_json(found.value), found.mod_revision

    def get(self, job_id: str) -> JobRecord:
        return self.get_versioned(job_id)[0]

    def forget(self, job_id: str) -> None:
        """Drop what this instance cached of a job after a write to it (its own, or the leader's
        for a write this standby forwarded): its next read sees the write."""
        self._recent.pop(job_id, None)
        self.on_change(job_id)

    def get_recent(self, job_id: str) -> JobRecord:
        """The job record, read from etcd at most every ``record_cache_s`` (for the workers'
        frequent callbacks: each etcd read wakes the cores that training shares)."""
        now = time.monotonic()
        cached = self._recent.get(job_id)
        if cached is not None and now - cached[0] < self.record_cache_s:
            return cached[1]
        record = self.get(job_id)
        self._recent[job_id] = (now, record)
        return record

    def list(
        self, *, state: JobState | None = None, limit: int = 50, cursor: str | None = None
    ) -> tuple[list[JobRecord], str | None]:
        """Jobs in id order after ``cursor``; the second value is the next cursor or None."""
        out: list[JobRecord] = []
        after = keys.job(cursor) if cursor else None
        while len(out) < limit:
            batch = self.store.list_prefix(keys.JOBS, start_after=after, limit=max(limit, 100))
            for entry in batch:
                after = entry.key
                record = JobRecord.from_json(entry.value)
                if state is None or record.state == state:
                    out.append(record)
                    if len(out) == limit:
                        more = self.store.list_prefix(keys.JOBS, start_after=after, limit=1)
                        return out, (record.id if more else None)
            if len(batch) < max(limit, 100):
                break
        return out, None

    def all_versioned(self) -> builtins.list[tuple[JobRecord, int]]:
        """Every job with its mod_revision, in id order (one range read per 1,000 jobs)."""
        out: builtins.list[tuple[JobRecord, int]] = []
        after: str | None = None
        while True:
            batch = self.store.list_prefix(keys.JOBS, start_after=after, limit=1000)
            out += [(JobRecord.from_json(e.value), e.mod_revision) for e in batch]
            if len(batch) < 1000:
                return out
            after = batch[-1].key

    def progress(self, job_id: str) -> Progress | None:
        """The newest progress: etcd's, or the newer one this instance holds but has not written."""
        found = self.store.get(keys.progress(job_id))
        stored = Progress.model_validate_json(found.value) if found else None
        held = self._progress.get(job_id)
        if held is not None and (stored is None or held.progress.time > stored.time):
            return held.progress
        return stored

    def worker_token(self, job_id: str) -> str:
        return derive_worker_token(self.secret, job_id)

    # ------------------------------------------------------------------ writes

    def create(self, spec: JobSpec, *, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """Store a new job for ``spec`` (parsed at the API's edge); with ``idempotency_key`` the
        same key returns the same job (second value False). Raises SpecError (a path outside the
        storage root) or ConflictError."""
        spec_hash = hashlib.sha256(spec_json(spec).encode()).hexdigest()
        fence = self.fence()  # taken before the reads the write depends on
        for _ in range(10):
            if idempotency_key is not None:
                existing = self._by_idempotency(idempotency_key, spec_hash)
                if existing is not None:
                    return existing, False
            record = self._new_record(spec, spec_hash)
            writes = [Write(keys.job(record.id), record.to_json(), 0)]
            if idempotency_key is not None:
                writes.append(Write(keys.idempotency(idempotency_key), record.id.encode(), 0))
            if self.commit(writes, fence=fence):
                self.on_change(record.id)
                self.on_job_write(record.id)
                return record, True
        raise ConflictError("could not store the job after repeated races; retry the request")

    def _by_idempotency(self, key: str, spec_hash: str) -> JobRecord | None:
        found = self.store.get(keys.idempotency(key))
        if found is None:
            return None
        record = self.get(found.value.decode())
        if record.spec_hash != spec_hash:
            raise ConflictError(
                f"Idempotency-Key was already used for job {record.id} with a different spec; "
                "send a new key to create another job"
            )
        return record

    def _new_record(self, spec: JobSpec, spec_hash: str) -> JobRecord:
        job_id = f"{spec.name[:50]}-{secrets.token_hex(3)}"
        ckpt = spec.checkpoint
        directory = checkpoint_dir(ckpt.dir, root=self.storage_root, job_id=job_id)
        resume = resume_source(ckpt.resume, root=self.storage_root, job_dir=directory)
        effective = ckpt.model_copy(update={"dir": str(directory), "resume": resume})
        spec = spec.model_copy(update={"checkpoint": effective})
        lo, hi = parse_nodes(spec.nodes)
        now = self.clock()
        record = JobRecord(
            id=job_id,
            name=spec.name,
            spec=spec,
            spec_hash=spec_hash,
            state_since=now,
            desired_nodes=spec.initial_nodes or hi,
            min_nodes=lo,
            max_nodes=hi,
            nproc_per_node=spec.nproc_per_node,
            max_restarts=spec.max_restarts,
            checkpoint_dir=str(directory),
            worker_token_hash=hash_token(derive_worker_token(self.secret, job_id)),
            created_at=now,
            updated_at=now,
        )
        return record.with_event(now, "submitted", f"submitted with nodes {spec.nodes}")

    def update(
        self, job_id: str, change: Callable[[JobRecord], JobRecord], *, fence: Fence | None = None
    ) -> JobRecord:
        """Apply ``change`` with compare-and-set, retrying lost races. A change that returns the
        record unchanged writes nothing. Raises NotFoundError, NotLeaderError, ConflictError.
        The fence is taken before the first read: the write lands only if the leadership under
        which the record was read still holds."""
        fence = fence if fence is not None else self.fence()
        for _ in range(50):
            record, revision = self.get_versioned(job_id)
            changed = change(record)
            if changed == record:
                return record
            if self.write_record(changed, revision, fence=fence):
                return changed
        raise ConflictError(f"job {job_id} changed too often to update; retry the request")

    def write_record(
        self, record: JobRecord, revision: int, *, fence: Fence | None = None, wake: bool = True
    ) -> bool:
        """Compare-and-set the job record (fenced); on success drop what this instance cached of
        it and tell the listeners (``wake``: the reconciler too). False when the revision moved."""
        if not self.commit([Write(keys.job(record.id), record.to_json(), revision)], fence=fence):
            return False
        self.forget(record.id)
        if wake:
            self.on_job_write(record.id)
        return True

    def scale(self, job_id: str, nodes: int) -> JobRecord:
        def change(record: JobRecord) -> JobRecord:
            failpoint("service_before_scale_write")  # between the read and the fenced write
            return request_scale(record, nodes, self.clock())

        return self.update(job_id, change)

    def cancel(self, job_id: str) -> JobRecord:
        """Idempotent: cancelling a finished or cancelling job returns it unchanged."""
        return self.update(job_id, lambda r: request_cancel(r, self.clock()))

    # ------------------------------------------------------------------ worker reports

    def report_progress(self, job: JobRecord, progress: Progress) -> None:
        recovering = job.state in (JobState.RECOVERING, JobState.RESCALING)
        held = self._progress.get(job.id)
        if recovering or held is None or self.clock() - held.written_at >= self.progress_flush_s:
            self.put(keys.progress(job.id), progress.model_dump_json().encode())
            self._progress[job.id] = _HeldProgress(progress, written=True, written_at=self.clock())
        else:
            self._progress[job.id] = _HeldProgress(progress, written=False, written_at=held.written_at)
        self.on_change(job.id)
        if recovering and progress.time > job.state_since:
            self.update(
                job.id,
                lambda r: first_step_done(r, progress.step, progress.time, world_size=progress.world_size),
            )

    def flush_progress(self, job_id: str) -> None:
        """Write the newest held progress if etcd lacks it, and forget it (the job finished)."""
        held = self._progress.pop(job_id, None)
        if held is not None and not held.written:
            self.put(keys.progress(job_id), held.progress.model_dump_json().encode())

    def heartbeat(self, job_id: str, launch_id: str, local_rank: int, step: int | None) -> None:
        """Record that a rank is alive: written to etcd when its stored beat is older than
        :attr:`heartbeat_write_s` (each etcd write is a WAL fsync on the training machine)."""
        now = self.clock()
        key = keys.heartbeat(job_id, launch_id, local_rank)
        if now - self._beats_written.get(key, -math.inf) < self.heartbeat_write_s:
            return
        value = f'{{"time": {now!r}, "step": {step if step is not None else "null"}}}'
        self.put(key, value.encode())
        if now - self._beats_pruned_at >= 4 * self.heartbeat_write_s:  # forget ranks of ended launches
            self._beats_written = {
                k: t for k, t in self._beats_written.items() if now - t < 4 * self.heartbeat_write_s
            }
            self._beats_pruned_at = now
        self._beats_written[key] = now

    def worker_event(self, job_id: str, event: WorkerEvent) -> JobRecord:
        progress = self.progress(job_id)

        def change(record: JobRecord) -> JobRecord:
            return apply_worker_event(merge_progress(record, progress), event, self.clock())

        return self.update(job_id, change)
