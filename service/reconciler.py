"""The leader's loop: observe every live job, decide with the pure state machine, act.

One pass per ``interval``: campaign for leadership (a non-leader does nothing), then per job
read the record and its mod_revision, ask the scheduler about nodes that have a handle, read
the heartbeats, run :func:`service.jobs.machine.reconcile`, write the new record with a
compare-and-set fenced by the leader's lease, and only then launch or cancel. A launch's handle
is written back right after the launch; a crash in between leaves a node in ``launching`` that
the next leader launches again under the same launch id, which the scheduler answers with the
first launch's handle (launch is idempotent per launch id). Restarting the service therefore
loses no job and launches no node twice.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from service.checkpoints.adopt import StorageAdoption
from service.etcd.election import LeaderElection
from service.etcd.gateway import KvGateway
from service.etcd.kv import Fence, Write
from service.jobs import keys
from service.jobs.cadence import cadence_of
from service.jobs.errors import NotFoundError, NotLeaderError
from service.jobs.events import first_step_done, merge_progress
from service.jobs.machine import (
    Cancel,
    Launch,
    Observation,
    Policy,
    confirm_launch,
    fail,
    launch_failed,
    reconcile,
)
from service.jobs.model import JobRecord, JobState, NodePhase, NodeRecord, Progress
from service.jobs.objectstore import uses_object_storage
from service.jobs.parts import JobParts
from service.jobs.queue import Grant, grant_all, still_waiting
from service.jobs.service import Stored
from service.jobs.slots import gang
from service.launch.protocol import UNKNOWN, GangLauncher, NodeStatus, Scheduler, gang_launcher, node_launch
from service.metrics import Metrics
from worker.etcdclient import GATEWAY_ENV, TOKEN_ENV, EtcdRefusedError, EtcdUnavailableError

log = logging.getLogger("elastrain.reconciler")


@dataclass(frozen=True, slots=True)
class LaunchContext:
    """What every launched node is told (in its environment)."""

    service_url: str
    storage_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The service's object storage variables (:func:`service.jobs.objectstore.storage_env`),
    told only to the nodes of a job whose checkpoints are on ``s3://``. On Kubernetes only the
    plain ones: the pods take the credentials from a Secret (:mod:`service.launch.dryrun`)."""


def service_env(job: JobRecord, ctx: LaunchContext, worker_token: str) -> dict[str, str]:
    """What the service tells every node of ``job``: its URL, the job's worker token, its
    checkpoint directory and its key-value gateway (the rendezvous and the peer group reach
    etcd only through it; a job is given no etcd endpoint or credential) and, for a job whose
    checkpoints are on ``s3://``, the service's object storage variables (they come after the
    job's own ``env``, which cannot replace them). Who the node is its scheduler adds
    (:func:`service.launch.apps.node_env`)."""
    resume = job.spec.checkpoint.resume if job.spec is not None else None
    storage = ctx.storage_env if uses_object_storage(job.checkpoint_dir, resume) else {}
    return {
        **storage,
        "ELASTRAIN_SERVICE_URL": ctx.service_url,
        TOKEN_ENV: worker_token,
        "ELASTRAIN_CHECKPOINT_DIR": job.checkpoint_dir,
        GATEWAY_ENV: gateway_url(ctx.service_url, job.id),
    }


def gateway_url(service_url: str, job_id: str) -> str:
    """The key-value gateway of ``job_id`` (:mod:`service.api.routes.gateway`), as an endpoint."""
    return f"{service_url.rstrip('/')}/v1/jobs/{job_id}/kv"


Seen = tuple[dict[str, float], dict[str, float]]
"""A job's heartbeats: per launch id, its quietest rank's newest beat and its newest beat."""


def _stopping(record: JobRecord) -> bool:
    return any(n.phase == NodePhase.STOPPING for n in record.nodes)


ADOPT_EVERY_S = 10.0
"""How often a leader re-reconciles live jobs' checkpoint registries with storage."""
SWEEP_AGAIN_S = 30.0
"""After a job ends, its heartbeats, reports and outcomes are deleted at once and again this
much later (a callback in flight as it ended may have written one more)."""
FAIL_AFTER_ERRORS = 3
"""Passes in a row that may fail on one job before the job is failed (a lost race or a blip
passes; a bug or data this version cannot handle repeats every pass)."""


class Reconciler:
    def __init__(
        self,
        parts: JobParts,
        scheduler: Scheduler,
        election: LeaderElection,
        *,
        launch: LaunchContext,
        wake: threading.Event | None = None,
        metrics: Metrics | None = None,
        policy: Policy | None = None,
        interval_s: float = 1.0,
        idle_interval_s: float = 5.0,
        storage: StorageAdoption | None = None,
        kv: KvGateway | None = None,
        clock: Callable[[], float] = time.time,
        slots: int | None = None,
        written: set[str] | None = None,
    ) -> None:
        self.jobs = parts.records
        self.progress = parts.progress
        self.heartbeats = parts.heartbeats
        self.writes = parts.writes
        self.scheduler = scheduler
        self.election = election
        self.launch_ctx = launch
        self.metrics = metrics or Metrics()
        self.policy = policy or Policy()
        self.interval_s = interval_s
        self.idle_interval_s = max(interval_s, idle_interval_s)
        self.busy = True
        """Whether the last pass saw a job in motion (not RUNNING or terminal) or acted."""
        self._wake = wake or threading.Event()
        """Set to run a pass now: a woken pass of ``written`` (the server sets it on every job
        write), or a full one after :meth:`wake`."""
        self._written = written if written is not None else set()
        """Jobs written since the loop last looked (the writers add to it and set ``wake``)."""
        self._full_now = False
        self._grants: dict[str, Grant] = {}
        """The queue's grants of the last pass (a woken pass reconciles a job whose grant moved)."""
        self.storage = storage
        """Reconciles the checkpoint registry with storage (None: no checkpoint duties)."""
        self.kv = kv
        """The jobs' key-value gateway (forgets a job that ended); None: none."""
        self.clock = clock
        self.slots = slots
        """Worker processes the local scheduler runs at once (the queue, :mod:`service.jobs.queue`);
        None: no queue here (a cluster's scheduler decides)."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._adopted_term: int | None = None
        self._led_since: float | None = None
        """When this instance last took over (its first pass as leader after one as a standby, or
        since it started): see ``Observation.led_since``."""
        self._adopted_at = float("-inf")
        self.budget = parts.budget
        self._sweep_again: dict[str, float] = {}
        """Jobs that ended, and when to drop their transient keys once more."""
        self._failing: dict[str, int] = {}
        """Per job, the passes in a row that failed on it."""
        self._passed_at = clock()
        """When the last pass completed (or the reconciler was made or started)."""

    @property
    def is_leader(self) -> bool:
        return self.election.fence is not None

    # ------------------------------------------------------------------ loop

    def run_once(self, only: set[str] | None = None) -> bool:
        """One pass; False when this instance is not the leader. ``only``: a woken pass, which
        reconciles the jobs written since the last pass and those :func:`woken_pass_takes`; the
        others wait for the next full pass (every ``interval_s``, or ``idle_interval_s`` while all
        are steadily RUNNING), so a write costs a pass no more than the listing and its own job."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        fence = self.election.campaign()
        self.metrics.is_leader.set(1 if fence else 0)
        if fence is None:
            self._passed_at = self.clock()  # a standby's pass is complete: it has nothing to do
            if self._adopted_term is not None:
                self.jobs.forget_all()
            self._adopted_term = None
            return False
        listed = [self._readable(stored, fence) for stored in self.jobs.scan()]
        records = [record for record, _ in listed]
        # A queued job waits for a job write (an end frees its slots), not for the clock.
        steady, waits = (JobState.RUNNING, JobState.QUEUED), (JobState.PENDING, JobState.QUEUED)
        self.busy = any(not r.state.terminal and r.state not in steady for r in records)
        grants = {} if self.slots is None else grant_all(records, slots=self.slots, now=self.clock())
        if self._adopted_term != fence.lease_id:
            self.jobs.forget_all()  # records held from before this term may be another leader's
            self._adopt_storage(records)  # finished jobs too, once per leadership term
            if self._adopted_term is None:  # beats may have gone to another leader, or to none
                self._led_since = self.clock()
            self._adopted_term = fence.lease_id
            only = None  # a new term's first pass is a full one
        elif only is None and self.clock() - self._adopted_at >= ADOPT_EVERY_S:
            # Workers under the service publish through it; this catches what a crash left behind.
            # A job that has not started has no workers: a queue of any length costs nothing here.
            self._adopt_storage([r for r in records if not r.state.terminal and r.state not in waits])
            self._adopted_at = self.clock()
        live = [
            (r, rev)
            for r, rev in listed
            if (not r.state.terminal or _stopping(r)) and not still_waiting(r, grants.get(r.id))
        ]
        if only is not None:
            live = [(r, rev) for r, rev in live if woken_pass_takes(r, only, grants, self._grants)]
        self._grants = grants
        if only is None:
            cadence = cadence_of(records, heartbeat_timeout_s=self.policy.heartbeat_timeout_s)
            self.heartbeats.cadence = cadence
            self.metrics.heartbeat_period.set(cadence.heartbeat_s)
            self.metrics.progress_period.set(cadence.progress_s)
        ids = [record.id for record, _ in live]
        progress, beats = self.progress.newest_of(ids), self.heartbeats.seen_of(ids)
        for record, revision in live:
            try:
                read = (progress[record.id], beats[record.id])
                self.reconcile_job(
                    record.id, fence, known=(record, revision), read=read, grant=grants.get(record.id)
                )
            except NotLeaderError:
                log.warning("lost leadership during a pass; stopping it")
                self.metrics.is_leader.set(0)
                return False
            except EtcdUnavailableError as exc:
                if not isinstance(exc, EtcdRefusedError):
                    raise  # etcd is down for every job: the loop counts it and retries
                self._job_failed(record, exc, fence)
            except Exception as exc:  # a bug, or data this version cannot handle: this job only
                self._job_failed(record, exc, fence)
            else:
                self._failing.pop(record.id, None)
        self._sweep(fence)
        if only is not None:
            return True  # the full passes are the ones timed and counted
        self.metrics.observe_jobs(records)
        self.metrics.passes.inc()
        self._passed_at = self.clock()
        self.metrics.last_pass.set(self._passed_at)
        self.metrics.pass_seconds.observe(time.perf_counter() - started)
        self.metrics.pass_cpu.inc(time.thread_time() - cpu_started)
        return True

    @property
    def stale_after_s(self) -> float:
        """A leader whose last completed pass is older than this is not ready: three idle
        intervals (15 s by default), time for two passes to fail or hang in a row."""
        return 3 * self.idle_interval_s

    def stalled(self) -> str | None:
        """Why this instance is not ready as the leader: its passes stopped completing (each
        fails, or one hangs). None while they complete, and on a standby (it runs none)."""
        if not self.is_leader:
            return None
        late = self.clock() - self._passed_at
        if late <= self.stale_after_s:
            return None
        return (
            f"the reconciler has not completed a pass for {late:.0f} s (it should every "
            f"{self.idle_interval_s:g} s at the latest); see elastrain_reconciler_errors_total and "
            "the service log"
        )

    def start(self) -> None:
        """Run passes (and the leader lease keep-alive) in background threads until stop()."""
        self._stop.clear()
        self._passed_at = self.clock()
        for target, name in ((self._loop, "reconciler"), (self._keepalive, "leader-keepalive")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, *, resign: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self._threads.clear()
        if resign:
            try:
                self.election.resign()
            except EtcdUnavailableError as exc:
                log.warning("could not resign leadership: %s", exc)

    def wake(self) -> None:
        """Run a full pass now."""
        self._full_now = True
        self._wake.set()

    def _loop(self) -> None:
        """Full passes every ``interval_s`` while a job is in motion; every ``idle_interval_s``
        while all are steadily RUNNING (each pass wakes the machine's cores: on a node shared with
        training that costs more than its CPU time); and a woken pass at once after a job write
        (see :meth:`run_once`): with many jobs, writes come in proportion to their number, and a
        full pass per write would cost the square of it."""
        full_at = 0.0
        while not self._stop.is_set():
            self._wake.clear()
            written = set()
            while self._written:
                written.add(self._written.pop())
            full, self._full_now = self._full_now or time.monotonic() >= full_at, False
            if full or written:
                self._pass(None if full else written)
                due = time.monotonic() + (self.interval_s if self.busy else self.idle_interval_s)
                full_at = due if full else min(full_at, due)
            self._wake.wait(max(0.0, full_at - time.monotonic()))

    def _pass(self, only: set[str] | None) -> None:
        try:
            self.run_once(only)
        except EtcdUnavailableError as exc:
            self.metrics.pass_errors.labels("store_unavailable").inc()
            log.warning("etcd unavailable: %s", exc)
        except Exception:
            self.metrics.pass_errors.labels("unexpected").inc()
            log.exception("reconciler pass failed")

    def _keepalive(self) -> None:
        period = max(0.5, self.election.ttl_s / 3)
        while not self._stop.wait(period):
            try:
                if self.election.fence is not None:
                    self.election.keep_alive()  # a lost lease is logged by the election
            except EtcdUnavailableError as exc:
                log.warning("leader keep-alive failed: %s", exc)

    def _adopt_storage(self, records: list[JobRecord]) -> None:
        """Reconcile the checkpoint registry with storage (steps published in-job, renamed but
        unrecorded, staging that can never publish)."""
        if self.storage is None:
            return
        for record in records:
            try:
                self.storage.adopt(record)
            except Exception as exc:  # one job's storage never stops the pass for the others
                self.metrics.pass_errors.labels("adopt").inc()
                log.warning("job %s: reconciling checkpoints with storage failed: %r", record.id, exc)

    # ------------------------------------------------------------------ one bad job

    def _readable(self, stored: Stored, fence: Fence) -> tuple[JobRecord, int]:
        """A record that cannot be read is replaced by its FAILED stand-in (the bytes kept for
        the operator) and counted; the pass goes on with the stand-in."""
        if stored.unreadable is None:
            return stored.record, stored.revision
        bad = stored.unreadable
        log.error("job %s: its stored record cannot be read (%s); failing the job", bad.job_id, bad.problem)
        self.metrics.job_errors.labels(bad.job_id, "unreadable").inc()
        if self.jobs.quarantine(bad, fence=fence) is None:
            return stored.record, stored.revision  # rewritten meanwhile: the next pass reads it again
        record, revision, _ = self.jobs.read(bad.job_id)
        return record, revision

    def _job_failed(self, record: JobRecord, exc: Exception, fence: Fence) -> None:
        """Reconciling one job raised: count it; after ``FAIL_AFTER_ERRORS`` passes in a row,
        fail the job with the error and stop its nodes, so that it stops costing every pass."""
        count = self._failing[record.id] = self._failing.get(record.id, 0) + 1
        self.metrics.job_errors.labels(record.id, "processing").inc()
        self.metrics.pass_errors.labels(type(exc).__name__).inc()
        log.warning(
            "job %s: reconciling failed (%d in a row): %r", record.id, count, exc, exc_info=count == 1
        )
        if count < FAIL_AFTER_ERRORS:
            return
        reason = (
            f"the reconciler failed on this job in {count} passes in a row "
            f"({type(exc).__name__}: {str(exc)[:300]}); the service failed the job so that the "
            "others go on"
        )
        try:
            failed = self.jobs.update(record.id, lambda r: fail(r, self.clock(), reason=reason), fence=fence)
        except NotLeaderError:
            raise
        except Exception:
            log.exception("job %s: could not record the failure; retried next pass", record.id)
            return
        self._failing.pop(record.id, None)
        for node in failed.nodes:
            if node.phase == NodePhase.STOPPING:
                self._cancel(node)

    # ------------------------------------------------------------------ one job

    def reconcile_job(
        self,
        job_id: str,
        fence: Fence,
        *,
        known: tuple[JobRecord, int] | None = None,
        read: tuple[Progress | None, Seen] | None = None,
        grant: Grant | None = None,
    ) -> JobRecord:
        """One job's pass. ``known``: the record and revision just listed (saves a read; a write
        that raced in since makes the compare-and-set fail and the next pass decide again);
        ``read``: its progress and heartbeats as the pass read them for every job at once;
        ``grant``: what the queue allows it (the pass computes it from the same listing)."""
        stored, revision = known if known is not None else self.jobs.get_versioned(job_id)
        statuses = self._statuses(stored)  # first: a step reported before a node ended is in the progress
        progress = self._newest(job_id, read[0] if read is not None else self.progress.newest(job_id))
        record = merge_progress(stored, progress)
        if progress is not None and progress.time > record.state_since:
            # a step after re-forming
            record = first_step_done(record, progress.step, progress.time, world_size=progress.world_size)
        seen = read[1] if read is not None else self.heartbeats.seen(job_id)
        observation = dataclasses.replace(self._observe(statuses, progress, seen), grant=grant)
        decision = reconcile(record, observation, self.policy)
        # The step alone is not worth an etcd write each pass (GET reads it from the progress
        # key); it is persisted with the next real change, and recoveries read it merged above.
        if decision.job.model_copy(update={"last_step": stored.last_step}) != stored:
            # NotLeaderError when etcd refuses the fence (this instance was paused past its lease)
            self.busy = True
            if not self.jobs.write_record(decision.job, revision, fence=fence, wake=False):
                return stored  # lost a race with an API write: the next pass decides again
        for recovery in decision.completed:  # written as taken: observed once, by one leader
            self.metrics.observe_recovery(job_id, recovery)
        launch_gang = gang_launcher(self.scheduler)
        together = gang(decision.job, decision.actions) if launch_gang is not None else []
        if launch_gang is not None and together:
            self._launch_gang(launch_gang, decision.job, together, fence)
        for action in decision.actions:
            if isinstance(action, Launch) and action.node not in together:
                self._launch(decision.job, action.node, fence)
            elif isinstance(action, Cancel):
                self._cancel(action.node)
        self.metrics.observe_job(decision.job, progress, now=self.clock())
        if decision.job.state.terminal and not record.state.terminal:
            self.progress.flush(job_id)
            self._adopt_storage([decision.job])
            self._drop_transient(job_id, fence)
            self._sweep_again[job_id] = self.clock() + SWEEP_AGAIN_S
            self.budget.forget(job_id)
            self.heartbeats.forget(job_id)
        return decision.job

    def _drop_transient(self, job_id: str, fence: Fence) -> None:
        """Delete the job's heartbeats, reports, outcomes and rendezvous (it ended)."""
        self.writes.commit(
            [Write(p, None, None, prefix=True) for p in keys.job_prefixes(job_id)], fence=fence
        )
        if self.kv is not None:
            self.kv.forget(job_id)

    def _sweep(self, fence: Fence) -> None:
        """Drop once more what a callback that read the record just before the job ended may have
        written just after (its worker token answers 409 from then on)."""
        now = self.clock()
        for job_id in [j for j, due in self._sweep_again.items() if due <= now]:
            self._drop_transient(job_id, fence)
            del self._sweep_again[job_id]

    def _newest(self, job_id: str, read: Progress | None) -> Progress | None:
        """The job's progress as the pass read it, or a newer report taken since (held in
        memory: the pass read every job's at its start, seconds ago with many jobs)."""
        held = self.progress.in_hand(job_id)
        return held if held is not None and (read is None or held.time > read.time) else read

    def _statuses(self, record: JobRecord) -> dict[str, NodeStatus]:
        statuses: dict[str, NodeStatus] = {}
        for node in record.nodes:
            if node.handle and node.phase in (NodePhase.RUNNING, NodePhase.STOPPING):
                try:
                    statuses[node.launch_id] = self.scheduler.status(node.handle)
                except Exception as exc:
                    log.warning("status of %s failed: %s", node.handle, exc)
                    statuses[node.launch_id] = UNKNOWN
        return statuses

    def _observe(self, statuses: dict[str, NodeStatus], progress: Progress | None, seen: Seen) -> Observation:
        last_seen, last_heard = seen
        return Observation(
            now=self.clock(),
            statuses=statuses,
            last_seen=last_seen,
            last_heard=last_heard,
            progress_at=progress.time if progress is not None else None,
            led_since=self._led_since,
        )

    def _launch(self, record: JobRecord, node: NodeRecord, fence: Fence) -> None:
        # An etcd error here stops the pass (the intent stays: the next pass launches), no node fails.
        env = service_env(record, self.launch_ctx, self.jobs.worker_token(record.id))
        try:
            handle = self.scheduler.launch(node_launch(record, node, env))
        except Exception as exc:
            self._launch_failed(record, [node], exc, fence)
            return
        self._confirm(record, [(node, handle)], fence)

    def _launch_gang(
        self, launch_gang: GangLauncher, record: JobRecord, nodes: list[NodeRecord], fence: Fence
    ) -> None:
        """Launch ``nodes`` as one gang (all of them start or none), their handles recorded in one
        write: a leader that dies between the launch and the write leaves every one of them
        without a handle, and the next launches the gang again under the same ids."""
        env = service_env(record, self.launch_ctx, self.jobs.worker_token(record.id))
        try:
            handles = launch_gang([node_launch(record, n, env) for n in nodes])
        except Exception as exc:
            self._launch_failed(record, nodes, exc, fence)
            return
        self._confirm(record, list(zip(nodes, handles, strict=True)), fence)

    def _launch_failed(
        self, record: JobRecord, nodes: list[NodeRecord], exc: Exception, fence: Fence
    ) -> None:
        log.warning("launch of %s failed: %s", ", ".join(n.launch_id for n in nodes), exc)
        message = str(exc) or type(exc).__name__

        def fail(r: JobRecord) -> JobRecord:
            for node in nodes:
                r = launch_failed(r, node.launch_id, message, self.clock())
            return r

        self.jobs.update(record.id, fail, fence=fence)

    def _confirm(self, record: JobRecord, launched: list[tuple[NodeRecord, str]], fence: Fence) -> None:
        """Record the handles of ``launched`` in one write; cancel those the job no longer wants."""
        self.metrics.launches.inc(len(launched))
        unwanted: list[NodeRecord] = []

        def confirm(r: JobRecord) -> JobRecord:
            unwanted.clear()
            for node, handle in launched:
                r, wanted = confirm_launch(r, node.launch_id, str(handle), self.clock())
                if not wanted:
                    unwanted.append(node.model_copy(update={"handle": handle}))
            return r

        try:
            self.jobs.update(record.id, confirm, fence=fence)
        except NotFoundError:
            unwanted[:] = [node.model_copy(update={"handle": handle}) for node, handle in launched]
        for node in unwanted:
            self._cancel(node)

    def _cancel(self, node: NodeRecord) -> None:
        if not node.handle:
            return
        try:
            self.scheduler.cancel(node.handle)
            self.metrics.cancels.inc()
        except Exception as exc:
            log.warning("cancel of %s failed (retried next pass if still running): %s", node.handle, exc)


def woken_pass_takes(
    record: JobRecord, written: set[str], grants: Mapping[str, Grant], before: Mapping[str, Grant]
) -> bool:
    """Whether a woken pass reconciles this live job: it was written, it is not steadily RUNNING
    (it starts, waits, recovers, rescales or stops: a write may have freed what it waits for), or
    the queue's grant moved since the last pass. A steadily running job's nodes and heartbeats are
    the full pass's to look at. Pure."""
    return (
        record.id in written
        or record.state != JobState.RUNNING
        or grants.get(record.id) != before.get(record.id)
    )
