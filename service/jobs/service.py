"""Job records on the state store: create (idempotent), read, list, change with compare-and-set.

Synchronous on purpose (the etcd client is sync); the API calls it from a thread pool. Every change is
``update(job_id, change)``: read the record and its mod_revision, apply a pure ``change``, write
it back only if the revision is unchanged, retry on a lost race. Every write goes through
:class:`~service.jobs.writes.LeaderWrites` (fenced by this instance's leadership). Errors are
:mod:`service.jobs.errors`, which the API maps to HTTP statuses.
"""

from __future__ import annotations

import builtins
import hashlib
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from service.etcd.kv import Fence, KVStore, Write, read_all
from service.jobs import keys, peer
from service.jobs.cache import RevisionCache, TTLCache
from service.jobs.cadence import HEARTBEAT_S
from service.jobs.claims import check_free, claim_write
from service.jobs.errors import ConflictError, NotFoundError
from service.jobs.events import WINDOW_S, WorkerEvent, apply_worker_event, first_step_done, merge_progress
from service.jobs.heartbeats import Heartbeats
from service.jobs.machine import request_cancel, request_scale
from service.jobs.model import JobRecord, JobState, Progress
from service.jobs.objectstore import ObjectStorage, is_s3
from service.jobs.paths import check_reachable, checkpoint_dir, resume_source, s3_location
from service.jobs.progress import ProgressBuffer
from service.jobs.salvage import Unreadable, decode, salvage
from service.jobs.tokens import derive_worker_token, hash_token
from service.jobs.writes import LeaderWrites
from worker.checkpoint.owner import claim
from worker.errors import SpecError
from worker.failpoints import failpoint
from worker.jobspec.spec import JobSpec, parse_nodes, spec_json

log = logging.getLogger("elastrain.jobs")


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


SCAN_READS_ONE_BY_ONE = 32
"""Changed records :meth:`JobService.scan` reads one by one; past that, one full listing."""


class Stored(NamedTuple):
    """A job key as read: the record (or the stand-in of one that cannot be read), its
    mod_revision, and why it cannot be read (None: it can)."""

    record: JobRecord
    revision: int
    unreadable: Unreadable | None


class JobService:
    """The job records of one service instance. ``on_change(job_id)`` hears of every write to a
    job (this instance's caches drop it); ``on_job_write(job_id)`` of every write of a record
    itself (the reconciler wakes)."""

    def __init__(
        self,
        writes: LeaderWrites,
        *,
        storage_root: Path,
        secret: bytes,
        progress: ProgressBuffer,
        heartbeats: Heartbeats | None = None,
        clock: Callable[[], float] = time.time,
        on_change: Callable[[str], None] = lambda job_id: None,
        on_job_write: Callable[[str], None] = lambda job_id: None,
        record_cache_s: float = 30.0,
        merge_window_s: float = WINDOW_S,
        object_storage: ObjectStorage | None = None,
    ) -> None:
        self.writes = writes
        self.storage_root = storage_root
        self.object_storage = object_storage
        """The service's object storage (None: a job's ``s3://`` location is refused at submit)."""
        self.secret = secret
        self.progress = progress
        """The jobs' newest progress (a worker event merges its step into the record)."""
        self.heartbeats = heartbeats
        """The ranks' heartbeats (a recovery report's lost nodes' last sign of life)."""
        self.clock = clock
        self._on_change = on_change
        self._on_job_write = on_job_write
        self.merge_window_s = merge_window_s
        """How long a completed incident takes late reports of it (two heartbeat timeouts)."""
        self._recent = TTLCache[JobRecord](record_cache_s, clock=time.monotonic)
        """Records for :meth:`get_recent`. Only the leader writes records, and this instance's
        own writes drop them at once, so while it leads nothing it holds is stale; the reconciler
        empties it when a leadership term begins or ends (:meth:`forget_all`), and
        ``record_cache_s`` bounds what a missed drop could cost."""
        self._decoded = RevisionCache[JobRecord]()

    @property
    def store(self) -> KVStore:
        return self.writes.store

    # ------------------------------------------------------------------ reads

    def read(self, job_id: str) -> Stored:
        """The job's record as stored (or the stand-in of one that cannot be read, see
        :mod:`service.jobs.salvage`), with its revision."""
        found = self.store.get(keys.job(job_id)) if valid_job_id(job_id) else None
        if found is None:
            raise NotFoundError(f"no job {job_id!r}; list jobs with GET /v1/jobs or `elastrain jobs`")
        return self._decode(keys.job(job_id), found.value, found.mod_revision)

    def get_versioned(self, job_id: str) -> tuple[JobRecord, int]:
        stored = self.read(job_id)
        return stored.record, stored.revision

    def get(self, job_id: str) -> JobRecord:
        return self.read(job_id).record

    def _decode(self, key: str, raw: bytes, revision: int) -> Stored:
        """The record stored at ``revision``; decoded once per revision (records are frozen), so
        that a pass over jobs that did not change, finished ones above all, decodes nothing."""
        known = self._decoded.get(key, revision)
        if known is not None:
            return Stored(known, revision, None)
        record, unreadable = decode(key.removeprefix(keys.JOBS), raw, revision, now=self.clock())
        if unreadable is None:  # a stand-in carries the time it was made: made again each read
            self._decoded.put(key, revision, record)
        return Stored(record, revision, unreadable)

    def forget(self, job_id: str) -> None:
        """Drop what this instance cached of a job after a write to it (its own, or the leader's
        for a write this standby forwarded): its next read sees the write."""
        self._recent.drop(job_id)
        self._on_change(job_id)

    def forget_all(self) -> None:
        """Drop every record :meth:`get_recent` holds, and take no held progress for the newest:
        leadership changed hands, and what the other leader wrote may differ."""
        self._recent.clear()
        self.progress.new_term()

    def cached_recent(self, job_id: str) -> JobRecord | None:
        """What :meth:`get_recent` holds of the job now (None: it would read etcd)."""
        return self._recent.get(job_id)

    def get_recent(self, job_id: str) -> JobRecord:
        """The job record as this instance last read or wrote it (for the workers' frequent
        callbacks: each etcd read wakes the cores that training shares). A read that raced a
        write of the job is returned but not kept."""
        cached = self._recent.get(job_id)
        if cached is not None:
            return cached
        stamp = self._recent.stamp()
        record = self.get(job_id)
        self._recent.put(job_id, record, stamp=stamp)
        return record

    def list(
        self, *, state: JobState | None = None, limit: int = 50, cursor: str | None = None
    ) -> tuple[list[JobRecord], str | None]:
        """Jobs in id order after ``cursor``; the second value is the next cursor or None. An
        unfiltered page reads its own records and one more (whether there are more), no others."""
        out: list[JobRecord] = []
        after = keys.job(cursor) if cursor else None
        size = limit + 1 if state is None else max(limit, 100)
        while len(out) < limit:
            batch = self.store.list_prefix(keys.JOBS, start_after=after, limit=size)
            for i, entry in enumerate(batch):
                after = entry.key
                record = self._decode(entry.key, entry.value, entry.mod_revision).record
                if state is None or record.state == state:
                    out.append(record)
                    if len(out) == limit:
                        more = i + 1 < len(batch) or self.store.list_prefix(
                            keys.JOBS, start_after=after, limit=1, keys_only=True
                        )
                        return out, (record.id if more else None)
            if len(batch) < size:
                break
        return out, None

    def scan(self) -> builtins.list[Stored]:
        """Every job as stored, in id order; a record that cannot be read comes as its stand-in,
        with why (the reconciler quarantines it). One keys-only range read per 1,000 jobs (keys
        and revisions), then the values of only the records that changed since this instance
        decoded them: a read each, or one full listing when many changed (a new leader, a queue
        that moved). A pass over jobs that did not change, queued or finished, reads no value."""
        listed = read_all(self.store, keys.JOBS, keys_only=True)
        known = [self._decoded.get(e.key, e.mod_revision) for e in listed]
        missing = [e.key for e, record in zip(listed, known, strict=True) if record is None]
        if len(missing) > SCAN_READS_ONE_BY_ONE:
            return [self._decode(e.key, e.value, e.mod_revision) for e in read_all(self.store, keys.JOBS)]
        fresh = {key: found for key in missing if (found := self.store.get(key)) is not None}
        out: builtins.list[Stored] = []
        for entry, record in zip(listed, known, strict=True):
            if record is not None:
                out.append(Stored(record, entry.mod_revision, None))
            elif entry.key in fresh:  # else it was deleted since the listing
                value, revision = fresh[entry.key]
                out.append(self._decode(entry.key, value, revision))
        return out

    def quarantine(self, bad: Unreadable, *, fence: Fence | None = None) -> JobRecord | None:
        """Replace a record that cannot be read by its FAILED stand-in and keep the bytes as found
        under ``keys.quarantine``: one compare-and-set on the bad record's revision (a record
        fixed meanwhile is left alone: None). Idempotent per revision."""
        stand_in = salvage(bad, now=self.clock())
        writes = [
            Write(keys.job(bad.job_id), stand_in.to_json(), bad.revision),
            Write(keys.quarantine(bad.job_id), bad.raw, None),
        ]
        if not self.writes.commit(writes, fence=fence):
            return None
        self.forget(bad.job_id)
        return stand_in

    def worker_token(self, job_id: str) -> str:
        return derive_worker_token(self.secret, job_id)

    # ------------------------------------------------------------------ writes

    def create(
        self, spec: JobSpec, *, idempotency_key: str | None = None, notes: tuple[str, ...] = ()
    ) -> tuple[JobRecord, bool]:
        """Store a new job for ``spec`` (parsed at the API's edge); with ``idempotency_key`` the
        same key returns the same job (second value False). ``notes``: what the submitted event
        adds (the admission's). Raises SpecError (a path outside the storage root) or
        ConflictError."""
        spec_hash = hashlib.sha256(spec_json(spec).encode()).hexdigest()
        self._check_object_storage(spec)
        fence = self.writes.fence()  # taken before the reads the write depends on
        for _ in range(10):
            if idempotency_key is not None:
                existing = self._by_idempotency(idempotency_key, spec_hash)
                if existing is not None:
                    return existing, False
            record = self._new_record(spec, spec_hash, notes)
            directory = record.checkpoint_place
            check_free(self.store, directory, root=self._real_root, job_id=record.id)
            writes = [
                Write(keys.job(record.id), record.to_json(), 0),
                claim_write(directory, record.id, now=record.created_at),
            ]
            if idempotency_key is not None:
                writes.append(Write(keys.idempotency(idempotency_key), record.id.encode(), 0))
            writes += desired_writes(record)
            if self.writes.commit(writes, fence=fence):
                try:
                    if isinstance(directory, Path):  # on S3 the etcd claim is the only one
                        self._mark(directory, record.id)
                except BaseException:
                    self._undo(writes, fence=fence)
                    raise
                self._on_change(record.id)
                self._on_job_write(record.id)
                return record, True
        raise ConflictError("could not store the job after repeated races; retry the request")

    def _check_object_storage(self, spec: JobSpec) -> None:
        """A location on S3 in the spec must answer the service's credentials: :class:`PathError`
        (422) naming the field otherwise, before anything is stored."""
        ckpt = spec.checkpoint
        for field, given in (("checkpoint.dir", ckpt.dir), ("checkpoint.resume", ckpt.resume)):
            if given is not None and is_s3(given):
                loc = s3_location(given, field=field, storage=self.object_storage)
                assert self.object_storage is not None  # s3_location refuses without one
                check_reachable(loc, field=field, storage=self.object_storage)

    def _undo(self, writes: Sequence[Write], *, fence: Fence | None) -> None:
        """Take back a new job whose follow-up failed (nothing has been told of it yet): delete
        what its create wrote, in one transaction, while its record is still the one written."""
        stored = self.store.get(writes[0].key)
        if stored is None:
            return
        undo = [
            Write(writes[0].key, None, stored.mod_revision),
            *(Write(w.key, None, None) for w in writes[1:]),
        ]
        try:
            if self.writes.commit(undo, fence=fence):
                return
        except Exception as exc:  # the original error is the one to raise
            log.error("could not take back the job stored at %s: %s", writes[0].key, exc)
            return
        log.error("could not take back the job stored at %s: it changed meanwhile", writes[0].key)

    @property
    def _real_root(self) -> Path:
        return Path(os.path.realpath(self.storage_root))

    def _mark(self, directory: Path, job_id: str) -> None:
        """The owner marker the workers check, written now that etcd holds the claim (a worker
        writes it at its start too, if this could not)."""
        try:
            claim(directory, job_id)
        except (OSError, SpecError) as exc:
            log.warning("job %s: could not write the owner marker in %s: %s", job_id, directory, exc)

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

    def _new_record(self, spec: JobSpec, spec_hash: str, notes: tuple[str, ...] = ()) -> JobRecord:
        job_id = f"{spec.name[:50]}-{secrets.token_hex(3)}"
        ckpt = spec.checkpoint
        storage = self.object_storage
        directory = checkpoint_dir(ckpt.dir, root=self.storage_root, job_id=job_id, storage=storage)
        resume = resume_source(ckpt.resume, root=self.storage_root, job_dir=directory, storage=storage)
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
            recovery_mode=peer.recovery_mode(spec),
            spares=peer.spares(spec),
            max_incidents=peer.max_incidents(spec),
            desired_epoch=1,
            worker_token_hash=hash_token(derive_worker_token(self.secret, job_id)),
            created_at=now,
            updated_at=now,
        )
        said = "; ".join((f"submitted with nodes {spec.nodes}", peer.recovery_why(spec), *notes))
        return record.with_event(now, "submitted", said)

    def update(
        self,
        job_id: str,
        change: Callable[[JobRecord], JobRecord],
        *,
        fence: Fence | None = None,
        also: Callable[[JobRecord], builtins.list[Write]] | None = None,
    ) -> JobRecord:
        """Apply ``change`` with compare-and-set, retrying lost races. A change that returns the
        record unchanged writes nothing. Raises NotFoundError, NotLeaderError, ConflictError.
        The fence is taken before the first read: the write lands only if the leadership under
        which the record was read still holds. ``also``: more writes of the changed record's,
        in the same transaction."""
        fence = fence if fence is not None else self.writes.fence()
        for _ in range(50):
            record, revision, unreadable = self.read(job_id)
            changed = change(record)
            if changed == record:
                return record
            if unreadable is not None:
                raise ConflictError(
                    f"job {job_id}'s stored record cannot be read ({unreadable.problem}); the "
                    "reconciler fails the job and keeps the record as found"
                )
            if self.write_record(changed, revision, fence=fence, also=also(changed) if also else ()):
                return changed
        raise ConflictError(f"job {job_id} changed too often to update; retry the request")

    def write_record(
        self,
        record: JobRecord,
        revision: int,
        *,
        fence: Fence | None = None,
        wake: bool = True,
        also: Sequence[Write] = (),
    ) -> bool:
        """Compare-and-set the job record (fenced), with ``also`` in the same transaction; on
        success drop what this instance cached of it and tell the listeners (``wake``: the
        reconciler too). False when the revision moved."""
        writes = [Write(keys.job(record.id), record.to_json(), revision), *also]
        if not self.writes.commit(writes, fence=fence):
            return False
        self.forget(record.id)
        if wake:
            self._on_job_write(record.id)
        return True

    def scale(self, job_id: str, nodes: int) -> JobRecord:
        """Set the desired node count; a peer-mode job's workers are told in the same write."""

        def change(record: JobRecord) -> JobRecord:
            failpoint("service_before_scale_write")  # between the read and the fenced write
            return request_scale(record, nodes, self.clock())

        return self.update(job_id, change, also=desired_writes)

    def cancel(self, job_id: str) -> JobRecord:
        """Idempotent: cancelling a finished or cancelling job returns it unchanged."""
        return self.update(job_id, lambda r: request_cancel(r, self.clock()))

    # ------------------------------------------------------------------ worker reports

    def progress_reported(self, job: JobRecord, progress: Progress) -> JobRecord:
        """A progress report after a re-formation ends a recovery or a rescale (see
        :func:`~service.jobs.events.first_step_done`); returns the record as it is now."""
        if job.state not in (JobState.RECOVERING, JobState.RESCALING) or progress.time <= job.state_since:
            return job
        return self.update(
            job.id, lambda r: first_step_done(r, progress.step, progress.time, world_size=progress.world_size)
        )

    def worker_event(self, job_id: str, event: WorkerEvent) -> JobRecord:
        progress = self.progress.newest(job_id)
        progress_at = progress.time if progress is not None else None
        beats = self.heartbeats
        heard = beats.quietest(job_id) if beats is not None and event.kind == "recovery" else None

        def change(record: JobRecord) -> JobRecord:
            merged = merge_progress(record, progress)
            return apply_worker_event(
                merged, event, self.clock(), progress_at=progress_at, window_s=self.merge_window_s,
                heard=heard, beat_s=beats.cadence.heartbeat_s if beats is not None else HEARTBEAT_S,
            )  # fmt: skip

        return self.update(job_id, change)


def desired_writes(record: JobRecord) -> list[Write]:
    """The write of what a peer-mode job's workers aim for (``keys.group_desired``): the
    service is etcd's root, the key is under the job's rendezvous prefix. None in restart mode."""
    value = peer.desired(record)
    return [] if value is None else [Write(keys.group_desired(record.id), value, None)]
