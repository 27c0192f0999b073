"""Phase 2 of a save, for jobs under the service.

Each rank POSTs its phase-1 report (``worker.checkpoint.commit.report_to_json``). Reports are
kept in etcd per (step, generation, seq); once all W are there, the pure
``worker.checkpoint.commit.decide`` says publish, wait or abort, exactly as the in-job
coordinator does, and the same I/O publishes (``worker.checkpoint.publish.publish_staged``:
manifest, fsync, rename, ``latest``). One instance claims the outcome key with a create-only
write before publishing, so nothing is published twice; the outcome is then recorded for the
ranks to read, the checkpoint in the registry, and retention runs (only after the successor is
published). A claim whose publisher died is taken over: the publish is finished, or aborted
when the round is incomplete.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable

from service.checkpoints.registry import Registry
from service.checkpoints.results import OUTCOME_RECORD, CheckpointOutcome, PublishClaim
from service.checkpoints.retention import retain
from service.etcd.kv import Write
from service.jobs import keys
from service.jobs.errors import InvalidRequestError, OverBudgetError
from service.jobs.model import JobRecord
from service.jobs.writes import LeaderWrites
from service.metrics import Metrics
from worker.checkpoint.commit import Expected, Report, build_manifest, decide, report_from_json
from worker.checkpoint.final import no_space
from worker.checkpoint.places import abort_staged, publish_staged, staged_sizes, staging_of
from worker.errors import ElastrainError

log = logging.getLogger("elastrain.coordinator")
# A publish claim older than this, held by another service instance, belongs to a dead publisher.
STALE_CLAIM_S = 10.0
MAX_OPEN_ROUNDS = 4
"""Saves of one job that may collect reports at once (a save in flight, an async one behind it,
one the ranks gave up on that a later publish collects)."""
KEEP_OUTCOMES = 16
"""Outcomes of a job's newest rounds kept in etcd."""


def _older(step: int, newest: int) -> str:
    return f"step {step} is older than the published step {newest}"


def _round_step(name: str) -> int:
    """The step of a report round's key name (``<step>-<generation>-<seq>``)."""
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else -1


def parse_report(body: bytes) -> Report:
    """A rank's report, or :class:`InvalidRequestError` saying what is wrong with it."""
    try:
        report = report_from_json(body)
    except ValueError as exc:
        raise InvalidRequestError(
            f"{exc}; send the JSON of worker.checkpoint.commit.report_to_json"
        ) from None
    if not (0 <= report.rank < report.world_size and report.step >= 0 and report.generation >= 0):
        raise InvalidRequestError(
            f"rank {report.rank} / world size {report.world_size} / step {report.step} / "
            f"generation {report.generation} are out of range"
        )
    return report


class Publisher:
    """Takes the ranks' reports and publishes each complete, consistent round once."""

    def __init__(
        self,
        writes: LeaderWrites,
        registry: Registry,
        *,
        metrics: Metrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._writes = writes
        self._registry = registry
        self._metrics = metrics
        self._clock = clock
        self.instance = uuid.uuid4().hex

    def report(self, record: JobRecord, body: bytes, *, seq: int = 0) -> CheckpointOutcome:
        """Take one rank's report; publish when the round is complete. Idempotent per rank."""
        report = parse_report(body)
        step, generation = report.step, report.generation
        known = self.outcome(record, step, generation, seq=seq)
        if known.status != "pending":
            return known
        if record.state.terminal:
            return CheckpointOutcome.of("aborted", step, generation, f"job {record.id} is {record.state}")
        newest = record.last_published_step
        if newest is not None and step < newest:  # answered, never stored (see outcome())
            self._collect(record, step, generation, _older(step, newest))
            return CheckpointOutcome.of("aborted", step, generation, _older(step, newest))
        self._check_open_rounds(record, keys.report_round(record.id, step, generation, seq))
        self._writes.put(keys.report(record.id, step, generation, report.rank, seq), body)
        reports = self._round(record.id, step, generation, seq)
        expected = Expected(step, generation, report.world_size)
        staging = staging_of(record.checkpoint_place, step, generation)
        complete = len(reports) >= report.world_size
        decision = decide(
            expected,
            reports,
            deadline_passed=False,
            observed_sizes=staged_sizes(staging) if complete else None,
        )
        if decision.action == "wait":
            return CheckpointOutcome.of("pending", step, generation, decision.reason)
        if decision.action == "abort":
            return self._finish_abort(record, report, seq, decision.reason)
        return self._publish(record, expected, reports, seq, decision.reason)

    def outcome(self, record: JobRecord, step: int, generation: int, *, seq: int = 0) -> CheckpointOutcome:
        """Where a reported step stands; finishes a publish whose publisher died."""
        found = self._writes.store.get(keys.outcome(record.id, step, generation, seq))
        newest = record.last_published_step
        if found is None and newest is not None and step < newest:
            return CheckpointOutcome.of("aborted", step, generation, _older(step, newest))
        if found is None:
            return CheckpointOutcome.of("pending", step, generation, "not all ranks have reported")
        stored = OUTCOME_RECORD.validate_json(found.value)
        if isinstance(stored, CheckpointOutcome):
            return stored
        if self._stale(stored):
            return self._take_over(record, step, generation, seq, found.mod_revision)
        return CheckpointOutcome.of("pending", step, generation, "publishing")

    def _stale(self, claim: PublishClaim) -> bool:
        """A publish claim whose publisher is gone: another instance's (a service killed while
        publishing) after STALE_CLAIM_S, our own after a much longer while."""
        age = self._clock() - claim.at
        return age > (STALE_CLAIM_S if claim.by != self.instance else 10 * STALE_CLAIM_S)

    def _claim(self) -> bytes:
        return PublishClaim(by=self.instance, at=self._clock()).model_dump_json().encode()

    def _take_over(
        self, record: JobRecord, step: int, generation: int, seq: int, revision: int
    ) -> CheckpointOutcome:
        """Finish an interrupted publish (idempotent: publish_staged keeps a step already renamed
        into place and only moves ``latest``), or abort it when the round cannot complete."""
        key = keys.outcome(record.id, step, generation, seq)
        if not self._writes.commit([Write(key, self._claim(), revision)]):
            return CheckpointOutcome.of("pending", step, generation, "publishing")  # taken over by another
        reports = self._round(record.id, step, generation, seq)
        if not reports or len(reports) < reports[0].world_size:
            reason = "the publisher died and the round is incomplete"
            return self._aborted(record, key, step, generation, reason)
        log.warning("job %s: finishing the publish of step %s that a dead service left", record.id, step)
        expected = Expected(step, generation, reports[0].world_size)
        return self._publish_claimed(
            record, expected, reports, seq, "publish finished after a service restart"
        )

    def _round(self, job_id: str, step: int, generation: int, seq: int) -> list[Report]:
        out = []
        for entry in self._writes.store.list_prefix(keys.report_round(job_id, step, generation, seq)):
            try:
                out.append(report_from_json(entry.value))
            except ValueError:
                continue
        return out

    def _finish_abort(self, record: JobRecord, report: Report, seq: int, reason: str) -> CheckpointOutcome:
        step, generation = report.step, report.generation
        result = CheckpointOutcome.of("aborted", step, generation, reason)
        key = keys.outcome(record.id, step, generation, seq)
        drop = Write(keys.report_round(record.id, step, generation, seq), None, None, prefix=True)
        if self._writes.commit([Write(key, result.model_dump_json().encode(), 0), drop]):
            self._counted_abort(record, step, reason)
            self._collect(record, step, generation, reason)
            self._prune_outcomes(record)
        return self.outcome(record, step, generation, seq=seq)

    def _counted_abort(self, record: JobRecord, step: int, reason: str) -> None:
        """An aborted step, counted once (a full volume also on its own counter) and said in
        the job's events."""
        self._metrics.aborted.inc()
        if no_space(reason):
            self._metrics.no_space.labels(record.id).inc()
        try:
            self._registry.aborted(record, step, reason)
        except ElastrainError as exc:  # the outcome is recorded; the event line is not worth failing it
            log.warning("job %s: could not record the abort of step %s: %s", record.id, step, exc)

    def _collect(self, record: JobRecord, step: int, generation: int, reason: str) -> None:
        try:
            abort_staged(staging_of(record.checkpoint_place, step, generation), reason)
        except (OSError, ElastrainError) as exc:
            log.warning("job %s: removing staging of step %s failed: %s", record.id, step, exc)

    def _check_open_rounds(self, record: JobRecord, round_prefix: str) -> None:
        """At most ``MAX_OPEN_ROUNDS`` saves of a job collect reports at once (each a key per
        rank in etcd): a report opening one more is refused (429). Rounds that can no longer
        publish (older than the newest published step) are dropped first."""
        base = keys.reports(record.id)
        entries = self._writes.store.list_prefix(base, keys_only=True)
        rounds = {e.key[len(base) :].split("/", 1)[0] for e in entries}
        current = round_prefix[len(base) :].rstrip("/")
        newest = record.last_published_step
        stale = {r for r in rounds if newest is not None and _round_step(r) < newest and r != current}
        if stale:
            self._writes.commit([Write(f"{base}{r}/", None, None, prefix=True) for r in sorted(stale)])
        open_rounds = rounds - stale
        if current not in open_rounds and len(open_rounds) >= MAX_OPEN_ROUNDS:
            raise OverBudgetError(
                f"job {record.id} already has {len(open_rounds)} checkpoint saves collecting reports "
                f"(at most {MAX_OPEN_ROUNDS}); a new one can start once one of them is published or "
                "aborted",
                retry_after=5.0,
                budget="rounds",
            )

    def _prune_outcomes(self, record: JobRecord) -> None:
        """Keep the outcomes of the newest ``KEEP_OUTCOMES`` rounds (a rank polls only its own
        recent one; an older step is answered 'aborted' or is in the registry)."""
        found = self._writes.store.list_prefix(keys.outcomes(record.id), keys_only=True)
        old = found[: max(0, len(found) - KEEP_OUTCOMES)]
        if old:
            self._writes.commit([Write(e.key, None, None) for e in old])

    def _aborted(
        self, record: JobRecord, key: str, step: int, generation: int, reason: str
    ) -> CheckpointOutcome:
        """Record a claimed step as aborted and collect its staging."""
        result = CheckpointOutcome.of("aborted", step, generation, reason)
        self._writes.put(key, result.model_dump_json().encode())
        self._counted_abort(record, step, reason)
        with contextlib.suppress(OSError, ElastrainError):
            abort_staged(staging_of(record.checkpoint_place, step, generation), reason)
        return result

    def _publish(
        self, record: JobRecord, expected: Expected, reports: list[Report], seq: int, reason: str
    ) -> CheckpointOutcome:
        step, generation = expected.step, expected.generation
        key = keys.outcome(record.id, step, generation, seq)
        if not self._writes.commit([Write(key, self._claim(), 0)]):
            return self.outcome(record, step, generation, seq=seq)
        return self._publish_claimed(record, expected, reports, seq, reason)

    def _publish_claimed(
        self, record: JobRecord, expected: Expected, reports: list[Report], seq: int, reason: str
    ) -> CheckpointOutcome:
        step, generation = expected.step, expected.generation
        started = time.perf_counter()
        key = keys.outcome(record.id, step, generation, seq)
        job_dir = record.checkpoint_place
        try:
            manifest = build_manifest(expected, reports)
            path = publish_staged(job_dir, staging_of(job_dir, step, generation), manifest)
        except (OSError, ElastrainError) as exc:
            return self._aborted(record, key, step, generation, f"publishing failed: {exc}")
        self._registry.record(record, manifest, path, verified=True)
        result = CheckpointOutcome.of("published", step, generation, reason, str(path))
        self._writes.put(key, result.model_dump_json().encode())
        self._writes.commit(
            [Write(keys.report_round(record.id, step, generation, seq), None, None, prefix=True)]
        )
        self._prune_outcomes(record)
        self._metrics.published.inc()
        self._metrics.publish.observe(time.perf_counter() - started)
        retain(self._registry, record, newest=step)
        return result
