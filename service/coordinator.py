"""The control plane's checkpoint coordinator (phase 2 of a save, for jobs under the service).

Each rank POSTs its phase-1 report (``worker.checkpoint.commit.report_to_json``). Reports are
kept in etcd per (step, generation, seq); once all W are there, the pure
``worker.checkpoint.commit.decide`` says publish, wait or abort, exactly as the in-job
coordinator does, and the same I/O publishes (``worker.checkpoint.publish.publish_staged``:
manifest, fsync, rename, ``latest``). One instance claims the outcome key with a create-only
write before publishing, so nothing is published twice; the outcome is then recorded for the
ranks to read, the checkpoint in the registry, and retention runs (only after the successor is
published). ``adopt`` reconciles the registry with storage when a leader starts: it records a
step that was renamed into place but not recorded and collects staging that can never publish.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from service.etcd.kv import Write
from service.jobs import keys
from service.jobs.model import JobRecord
from service.jobs.service import InvalidRequestError, JobService
from service.metrics import Metrics
from worker.checkpoint.commit import Expected, Report, build_manifest, decide, report_from_json
from worker.checkpoint.layout import (
    file_sizes,
    list_published,
    parse_staging_dir,
    staging_dir_name,
)
from worker.checkpoint.loadplan import bytes_read, needs_for_rank, plan_reads
from worker.checkpoint.manifest import MANIFEST_NAME, Manifest, manifest_from_json
from worker.checkpoint.publish import abort_staged, publish_staged
from worker.checkpoint.retention import CheckpointInfo, apply_retention
from worker.errors import ElastrainError

log = logging.getLogger("elastrain.coordinator")


def _outcome(status: str, step: int, generation: int, reason: str, path: str | None = None) -> dict[str, Any]:
    """The fields of ``worker.checkpoint.coordinator.Outcome`` plus ``status``."""
    return {
        "status": status,
        "published": status == "published",
        "step": step,
        "generation": generation,
        "reason": reason,
        "path": path,
    }


def _sizes_match(step_dir: Path, manifest: Manifest) -> bool:
    return all(
        (step_dir / name).is_file() and (step_dir / name).stat().st_size == f.size
        for name, f in manifest.files.items()
    )


PLAN_ALL_RANKS_UP_TO = 1024
"""``/resume`` without ``rank`` plans every rank only up to this world size."""
# A publish claim older than this, held by another service instance, belongs to a dead publisher.
STALE_CLAIM_S = 10.0


class CheckpointCoordinator:
    def __init__(
        self, jobs: JobService, *, metrics: Metrics | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.jobs = jobs
        self.store = jobs.store
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.instance = uuid.uuid4().hex

    # ------------------------------------------------------------------ phase 2

    def report(self, record: JobRecord, body: bytes, *, seq: int = 0) -> dict[str, Any]:
        """Take one rank's report; publish when the round is complete. Idempotent per rank."""
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
        step, generation = report.step, report.generation
        known = self.outcome(record, step, generation, seq=seq)
        if known["status"] != "pending":
            return known
        if record.state.terminal:
            return _outcome("aborted", step, generation, f"job {record.id} is {record.state}")
        newest = record.last_published_step
        if newest is not None and step < newest:
            return self._finish_abort(
                record, report, seq, f"step {step} is older than the published step {newest}"
            )
        self.jobs.put(keys.report(record.id, step, generation, report.rank, seq), body)
        reports = self._round(record.id, step, generation, seq)
        expected = Expected(step, generation, report.world_size)
        staging = Path(record.checkpoint_dir) / staging_dir_name(step, generation)
        complete = len(reports) >= report.world_size
        decision = decide(
            expected, reports, deadline_passed=False, observed_sizes=file_sizes(staging) if complete else None
        )
        if decision.action == "wait":
            return _outcome("pending", step, generation, decision.reason)
        if decision.action == "abort":
            return self._finish_abort(record, report, seq, decision.reason)
        return self._publish(record, expected, reports, seq, decision.reason)

    def outcome(self, record: JobRecord, step: int, generation: int, *, seq: int = 0) -> dict[str, Any]:
        key = keys.outcome(record.id, step, generation, seq)
        found = self.store.get(key)
        if found is None:
            return _outcome("pending", step, generation, "not all ranks have reported")
        result: dict[str, Any] = json.loads(found.value)
        if result["status"] == "publishing":
            if self._stale(result):
                return self._take_over(record, step, generation, seq, found.mod_revision)
            result = _outcome("pending", step, generation, "publishing")
        return result

    def _stale(self, claim: dict[str, Any]) -> bool:
        """A publish claim whose publisher is gone: another instance's (a service killed while
        publishing) after STALE_CLAIM_S, our own after a much longer while."""
        age = self.clock() - float(claim.get("at", 0.0))
        return age > (STALE_CLAIM_S if claim.get("by") != self.instance else 10 * STALE_CLAIM_S)

    def _take_over(
        self, record: JobRecord, step: int, generation: int, seq: int, revision: int
    ) -> dict[str, Any]:
        """Finish an interrupted publish (idempotent: publish_staged keeps a step already renamed
        into place and only moves ``latest``), or abort it when the round cannot complete."""
        key = keys.outcome(record.id, step, generation, seq)
        claim = {"status": "publishing", "by": self.instance, "at": self.clock()}
        if not self.jobs.commit([Write(key, json.dumps(claim).encode(), revision)]):
            return _outcome("pending", step, generation, "publishing")  # someone else took it over
        reports = self._round(record.id, step, generation, seq)
        if not reports or len(reports) < reports[0].world_size:
            result = _outcome("aborted", step, generation, "the publisher died and the round is incomplete")
            self.jobs.put(key, json.dumps(result).encode())
            self.metrics.aborted.inc()
            with contextlib.suppress(OSError):
                abort_staged(
                    Path(record.checkpoint_dir) / staging_dir_name(step, generation), result["reason"]
                )
            return result
        log.warning("job %s: finishing the publish of step %s that a dead service left", record.id, step)
        expected = Expected(step, generation, reports[0].world_size)
        return self._publish_claimed(
            record, expected, reports, seq, "publish finished after a service restart"
        )

    def _round(self, job_id: str, step: int, generation: int, seq: int) -> list[Report]:
        out = []
        for entry in self.store.list_prefix(keys.report_round(job_id, step, generation, seq)):
            try:
                out.append(report_from_json(entry.value))
            except ValueError:
                continue
        return out

    def _claim(self, key: str, value: dict[str, Any]) -> bool:
        return self.jobs.commit([Write(key, json.dumps(value).encode(), 0)])

    def _finish_abort(self, record: JobRecord, report: Report, seq: int, reason: str) -> dict[str, Any]:
        step, generation = report.step, report.generation
        result = _outcome("aborted", step, generation, reason)
        if self._claim(keys.outcome(record.id, step, generation, seq), result):
            self.metrics.aborted.inc()
            try:
                abort_staged(Path(record.checkpoint_dir) / staging_dir_name(step, generation), reason)
            except OSError as exc:
                log.warning("job %s: removing staging of step %s failed: %s", record.id, step, exc)
        return self.outcome(record, step, generation, seq=seq)

    def _publish(
        self, record: JobRecord, expected: Expected, reports: list[Report], seq: int, reason: str
    ) -> dict[str, Any]:
        step, generation = expected.step, expected.generation
        key = keys.outcome(record.id, step, generation, seq)
        if not self._claim(key, {"status": "publishing", "by": self.instance, "at": self.clock()}):
            return self.outcome(record, step, generation, seq=seq)
        return self._publish_claimed(record, expected, reports, seq, reason)

    def _publish_claimed(
        self, record: JobRecord, expected: Expected, reports: list[Report], seq: int, reason: str
    ) -> dict[str, Any]:
        step, generation = expected.step, expected.generation
        started = time.perf_counter()
        key = keys.outcome(record.id, step, generation, seq)
        job_dir = Path(record.checkpoint_dir)
        staging = job_dir / staging_dir_name(step, generation)
        try:
            manifest = build_manifest(expected, reports)
            path = publish_staged(job_dir, staging, manifest)
        except (OSError, ElastrainError) as exc:
            result = _outcome("aborted", step, generation, f"publishing failed: {exc}")
            self.jobs.put(key, json.dumps(result).encode())
            self.metrics.aborted.inc()
            with contextlib.suppress(OSError):
                abort_staged(staging, result["reason"])
            return result
        self._record(record, manifest, path, verified=True)
        result = _outcome("published", step, generation, reason, str(path))
        self.jobs.put(key, json.dumps(result).encode())
        self.jobs.commit(
            [Write(keys.report_round(record.id, step, generation, seq), None, None, prefix=True)]
        )
        self.metrics.published.inc()
        self.metrics.publish.observe(time.perf_counter() - started)
        self._retain(record, step)
        return result

    # ------------------------------------------------------------------ registry

    def _record(self, record: JobRecord, manifest: Manifest, path: Path, *, verified: bool) -> None:
        entry = {
            "step": manifest.step,
            "generation": manifest.generation,
            "world_size": manifest.world_size,
            "bytes": manifest.total_bytes,
            "files": len(manifest.files),
            "published_at": self.clock(),
            "verified": verified,
            "dir": str(path),
            "metrics": manifest.metrics,
        }
        self.jobs.put(keys.checkpoint(record.id, manifest.step), json.dumps(entry).encode())

        def newest(r: JobRecord) -> JobRecord:
            if r.last_published_step is not None and r.last_published_step >= manifest.step:
                return r
            moved = r.model_copy(update={"last_published_step": manifest.step})
            return moved.with_event(
                self.clock(), "checkpoint", f"published step {manifest.step} ({path.name})"
            )

        self.jobs.update(record.id, newest)

    def published(self, record: JobRecord) -> list[dict[str, Any]]:
        """The registry of published checkpoints, oldest first."""
        out = []
        for entry in self.store.list_prefix(keys.checkpoints(record.id)):
            item = json.loads(entry.value)
            item.pop("metrics", None)
            out.append(item)
        return out

    def _retain(self, record: JobRecord, newest: int) -> None:
        policy = record.spec.checkpoint.retention
        entries = [json.loads(e.value) for e in self.store.list_prefix(keys.checkpoints(record.id))]
        infos = [CheckpointInfo(int(e["step"]), e.get("metrics", {})) for e in entries]
        job_dir = Path(record.checkpoint_dir)
        for step in apply_retention(job_dir, policy, newest=newest, checkpoints=infos):
            self.jobs.commit([Write(keys.checkpoint(record.id, step), None, None)])

    # ------------------------------------------------------------------ resume

    def newest(self, record: JobRecord) -> tuple[dict[str, Any], Manifest] | None:
        """The newest published checkpoint whose manifest is present and valid."""
        entries = sorted(self.published(record), key=lambda e: -int(e["step"]))
        if not entries:
            entries = [
                {"step": s, "dir": str(p)} for s, p in reversed(list_published(Path(record.checkpoint_dir)))
            ]
        for entry in entries:
            try:
                manifest = manifest_from_json((Path(entry["dir"]) / MANIFEST_NAME).read_bytes())
            except (OSError, ElastrainError) as exc:
                log.warning("job %s: checkpoint step %s is not usable: %s", record.id, entry["step"], exc)
                continue
            if entry.get("verified", True) and _sizes_match(Path(entry["dir"]), manifest):
                return entry, manifest
        return None

    def resume(self, record: JobRecord, *, world_size: int | None, rank: int | None) -> dict[str, Any]:
        """What a starting worker group should load, and (for ``world_size``) its load plan."""
        found = self.newest(record)
        if found is None:
            return {"job": record.id, "checkpoint": None, "load_plan": None}
        entry, manifest = found
        checkpoint = {
            "step": manifest.step,
            "dir": entry["dir"],
            "world_size": manifest.world_size,
            "generation": manifest.generation,
            "bytes": manifest.total_bytes,
            "reshard": world_size is not None and world_size != manifest.world_size,
        }
        plan = None
        if world_size is not None and rank is None and world_size > PLAN_ALL_RANKS_UP_TO:
            raise InvalidRequestError(
                f"a load plan for all {world_size} ranks is too large to send; ask per rank with "
                f"rank= (or give world_size <= {PLAN_ALL_RANKS_UP_TO})"
            )
        if world_size is not None:
            ranks = [rank] if rank is not None else list(range(world_size))
            if any(r >= world_size for r in ranks):
                raise InvalidRequestError(f"rank {rank} is not below world_size {world_size}")
            plan = {str(r): self._plan(manifest, r, world_size, full=rank is not None) for r in ranks}
        return {"job": record.id, "checkpoint": checkpoint, "load_plan": plan}

    @staticmethod
    def _plan(manifest: Manifest, rank: int, world_size: int, *, full: bool) -> dict[str, Any]:
        ops = plan_reads(manifest, needs_for_rank(manifest, rank=rank, world_size=world_size))
        summary: dict[str, Any] = {
            "reads": len(ops),
            "bytes": bytes_read(ops),
            "files": sorted({op.file for op in ops}),
        }
        if full:
            summary["ops"] = [asdict(op) for op in ops]
        return summary

    # ------------------------------------------------------------------ storage reconciliation

    def adopt(self, record: JobRecord) -> None:
        """Record published steps missing from the registry, drop entries whose directory is
        gone, and collect staging that can never publish (all of it once the job is finished)."""
        job_dir = Path(record.checkpoint_dir)
        on_disk = dict(list_published(job_dir))
        recorded = {int(e["step"]): e for e in self.published(record)}
        for step in recorded:
            if step not in on_disk:
                self.jobs.commit([Write(keys.checkpoint(record.id, step), None, None)])
        for step, path in sorted(on_disk.items()):
            if step in recorded:
                continue
            try:
                manifest = manifest_from_json((path / MANIFEST_NAME).read_bytes())
            except (OSError, ElastrainError) as exc:
                log.warning("job %s: %s has no valid manifest: %s", record.id, path, exc)
                continue
            self._record(record, manifest, path, verified=_sizes_match(path, manifest))
            log.info("job %s: adopted published step %s found in storage", record.id, step)
        newest = max(on_disk, default=-1)
        if not job_dir.is_dir():
            return
        for child in job_dir.iterdir():
            staged = parse_staging_dir(child.name)
            if staged is not None and (record.state.terminal or staged[0] <= newest):
                abort_staged(child, f"collected by the service: step {staged[0]} can no longer be published")
