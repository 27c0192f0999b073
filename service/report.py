"""What a training run achieved and what its failures and checkpoints cost, from its run directory.

Run directory layout (a worker's ``checkpoint.dir``; for a service job ``record.checkpoint_dir``)::

    events.jsonl          rank 0's JSON-line events, appended by every attempt (torchrun
                          restart, rescale, rerun); lines that are not JSON objects are skipped
    run-record.json       the newest attempt's run record (versions, precision table, spec)
    step-<8 digits>/manifest.json   published checkpoints

Events used (all optional but ``progress``): ``progress`` (step, samples_seen, loss,
samples_per_second, world_size; and, from :meth:`worker.metrics.WorkerMetrics.progress_fields`,
``step_seconds`` list, ``data_wait_seconds``, ``comm_exposed_seconds``, ``tokens``,
``peak_memory_bytes``), ``started``, ``group_formed``, ``checkpoint_restored``, ``resumed``,
``run_record``, ``first_step``, ``skipped_step``, ``checkpoint_published``,
``checkpoint_aborted``, ``finished``, ``straggler`` (a rank the group named as slow:
:mod:`worker.train.stragglers`); in peer mode ``recovery_incident`` (one per
incident, from the leader that repaired the group: ``incident``, ``kind``, ``lost_launch_ids``,
``failed_at``, ``detected_at``, ``phases`` with the Unix times ``formed``, ``transferred``,
``ready``, ``bytes_from_peers``, ``voided_windows``, ``world_before``, ``world_after``),
``recovery`` and ``batch_replanned`` (the size of a re-formed group). A ``group_formed`` with a
``generation`` is a peer generation formed by processes that kept running, not the start of an
attempt. The run's world sizes are those it finished a step at. Everything here is pure except
:func:`load_run`.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.jobs.recovery import goodput, peer_incidents, recovery_phases
from worker.errors import ElastrainError

EVENTS_FILE = "events.jsonl"
RUN_RECORD_FILE = "run-record.json"
# An attempt begins with these; training events end the beginning.
_START = {
    *("started", "group_formed", "checkpoint_orphans_collected", "checkpoint_none_to_resume"),
    *("checkpoint_refused", "checkpoint_set_aside", "checkpoint_restored", "resumed", "run_record"),
}
_TRAIN = {
    *("progress", "first_step", "skipped_step", "grad_stats", "eval", "checkpoint_published"),
    *("checkpoint_aborted", "checkpoint_retention_deleted", "finished"),
}
_STEP_DONE = ("progress", "first_step", "skipped_step")
# Where an event says the size of the group that wrote it (or, for a peer recovery's record,
# the group it formed). In peer mode a re-formed group's rank 0 may have been another rank
# when the group formed, so its ``group_formed`` is not always in the file: the recovery's
# record (its leader writes it whatever its rank) and the batch plan say the size too.
_SIZE_KEYS = {
    **dict.fromkeys(("run_record", "progress", "group_formed", "finished"), "world_size"),
    **dict.fromkeys(("batch_replanned", "peer_outcome"), "world_size"),
    **dict.fromkeys(("recovery_incident", "recovery"), "world_after"),
}


class ReportError(ElastrainError):
    """The run directory cannot be read as a run (the message says what is missing)."""


@dataclass(frozen=True, slots=True)
class Run:
    """One run directory as read from disk."""

    path: str
    events: list[dict[str, Any]]
    run_record: dict[str, Any] | None = None
    manifests: list[dict[str, Any]] = field(default_factory=list)


def load_run(path: str | Path) -> Run:
    """Read a run directory (or a bare events file), or a job's ``s3://`` location (its events
    copies and manifests: :mod:`worker.report.bucket_events`). Raises :class:`ReportError`."""
    if str(path).startswith("s3://"):
        return _load_bucket_run(str(path))
    p = Path(path)
    events_path = p / EVENTS_FILE if p.is_dir() else p
    if not events_path.is_file():
        raise ReportError(
            f"{events_path} does not exist: a run directory holds the worker's events as {EVENTS_FILE} "
            "(rank 0's stdout JSON lines)"
        )
    events = parse_events(events_path.read_text(encoding="utf-8", errors="replace").splitlines())
    root = events_path.parent
    record = None
    if (root / RUN_RECORD_FILE).is_file():
        record = json.loads((root / RUN_RECORD_FILE).read_text())
    manifests = []
    for manifest in sorted(root.glob("step-*/manifest.json")):
        try:
            manifests.append(json.loads(manifest.read_text()))
        except (OSError, ValueError):
            continue
    return Run(str(p), events, record, manifests)


def _load_bucket_run(url: str) -> Run:
    from worker.checkpoint.storage import StorageError
    from worker.jobspec.location import parse_location
    from worker.report.bucket_events import read_run

    try:
        job = parse_location(url, field="report target")
        assert job is not None
        lines, manifests = read_run(job)
    except (ValueError, StorageError) as exc:
        raise ReportError(str(exc)) from None
    events = sorted(parse_events(lines), key=lambda e: e["time"])
    return Run(str(job), events, None, manifests)


def parse_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event and isinstance(event.get("time"), int | float):
            out.append(event)
    return out


def split_attempts(events: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Group events by attempt (one process group lifetime): a start event after training
    events, or a start event seen twice, begins the next attempt."""
    attempts: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    names: set[str] = set()
    for event in events:
        name = event["event"]
        peer_generation = name == "group_formed" and "generation" in event
        if name in _START and not peer_generation and (names & _TRAIN or name in names):
            attempts.append(current)
            current, names = [], set()
        current.append(event)
        names.add(name)
    if current:
        attempts.append(current)
    return attempts


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(slots=True)
class Attempt:
    events: list[dict[str, Any]]
    start: float = 0.0
    end: float = 0.0
    world_size: int | None = None
    resumed_step: int = 0
    last_step: int = 0
    finished: bool = False
    preempted: bool = False
    replica_mismatch: bool = False
    progress: list[dict[str, Any]] = field(default_factory=list)
    world_sizes: list[int] = field(default_factory=list)  # in the order the attempt ran at them
    trained_at: list[int] = field(default_factory=list)  # those it finished a step at

    @classmethod
    def of(cls, events: list[dict[str, Any]]) -> Attempt:
        a = cls(events, start=events[0]["time"], end=events[-1]["time"])
        a.progress = [e for e in events if e["event"] == "progress"]
        for e in events:
            size = e.get(_SIZE_KEYS.get(e["event"], ""))
            if isinstance(size, int) and not isinstance(size, bool) and size > 0:
                a.world_size = size  # the last one
                if size not in a.world_sizes:
                    a.world_sizes.append(size)
            if e["event"] in _STEP_DONE and a.world_size and a.world_size not in a.trained_at:
                a.trained_at.append(a.world_size)
            if e["event"] == "resumed":
                a.resumed_step = int(e.get("step", 0))
            if e["event"] in _TRAIN and isinstance(e.get("step"), int):
                a.last_step = max(a.last_step, e["step"])
        a.finished = any(e["event"] == "finished" for e in events)
        a.preempted = any(e["event"] == "preempted" for e in events)
        a.replica_mismatch = any(e["event"] == "replica_mismatch" for e in events)
        return a

    def first(self, *names: str) -> float | None:
        return next((e["time"] for e in self.events if e["event"] in names), None)

    def segments(self) -> list[tuple[int, list[dict[str, Any]]]]:
        """The progress events in runs at one world size each: a peer-mode attempt (the same
        processes) re-forms at other sizes without a restart, so one attempt can hold several."""
        out: list[tuple[int, list[dict[str, Any]]]] = []
        size = self.world_sizes[0] if self.world_sizes else 0
        for e in self.progress:
            size = int(e.get("world_size") or size)
            if not out or out[-1][0] != size:
                out.append((size, []))
            out[-1][1].append(e)
        return out


def _restart(prev: Attempt, nxt: Attempt, t0: float) -> dict[str, Any]:
    kind = "rerun" if prev.finished else "preemption" if prev.preempted else "failure"
    if prev.replica_mismatch and not prev.finished:  # stopped on purpose: the replicas disagreed
        kind = "replica_mismatch"
    after = nxt.world_sizes[0] if nxt.world_sizes else None  # prev.world_size: the last it ran at
    if prev.world_size and after and prev.world_size != after:
        kind = "rescale"
    phases = recovery_phases(
        failed_at=prev.end,
        detected_at=nxt.first("started"),
        group_formed_at=nxt.first("group_formed"),
        state_loaded_at=nxt.first("resumed") or nxt.first("checkpoint_restored", "checkpoint_none_to_resume"),
        first_step_at=nxt.first(*_STEP_DONE),
    )
    first_step = nxt.first(*_STEP_DONE)
    return {
        "kind": kind,
        "at_seconds": round(prev.end - t0, 3),
        "world_size_before": prev.world_size,
        "world_size_after": after,
        "last_step_before": prev.last_step,
        "resumed_step": nxt.resumed_step,
        "steps_lost": max(0, prev.last_step - nxt.resumed_step),
        "recovery_seconds": None if first_step is None else round(first_step - prev.end, 3),
        "phases": [{"name": p.name, "seconds": round(p.seconds, 3)} for p in phases],
    }


def _intervals(attempt: Attempt, keep_until: int | None) -> Iterable[tuple[dict[str, Any], float, float]]:
    """(progress event, step seconds in its interval, fraction of those steps kept)."""
    prev_t, prev_step = None, attempt.resumed_step
    for e in attempt.progress:
        steps = max(1, e["step"] - prev_step)
        timed = e.get("step_seconds")
        seconds = sum(timed) if isinstance(timed, list) else (None if prev_t is None else e["time"] - prev_t)
        limit = e["step"] if keep_until is None else min(e["step"], keep_until)
        if seconds is not None:
            yield e, seconds, max(0.0, min(1.0, (limit - prev_step) / steps))
        prev_t, prev_step = e["time"], e["step"]


def _step_times(attempts: Sequence[Attempt]) -> tuple[list[float], str]:
    exact = [s for a in attempts for e in a.progress for s in e.get("step_seconds") or []]
    if exact:
        return exact, "per step (worker timing)"
    approx: list[float] = []
    for a in attempts:
        prev = None
        for e in a.progress:
            if prev is not None and e["step"] > prev["step"]:
                n = e["step"] - prev["step"]
                approx += [(e["time"] - prev["time"]) / n] * n
            prev = e
    return approx, "progress intervals (event times)"


def _throughput(attempts: Sequence[Attempt]) -> dict[str, Any]:
    """Samples/s over the progress intervals, per world size and overall; the start of each
    attempt and each re-formation at another size (the interval that holds it) is left out."""
    per: dict[int, list[float]] = {}
    for size, progress in (seg for a in attempts for seg in a.segments()):
        if len(progress) < 2:
            continue
        first, last = progress[0], progress[-1]
        acc = per.setdefault(size, [0.0, 0.0, 0.0, 0.0])
        acc[0] += last["samples_seen"] - first["samples_seen"]
        acc[1] += last["time"] - first["time"]
        acc[2] += last["step"] - first["step"]
        acc[3] += sum(e.get("tokens") or 0 for e in progress[1:])
    rows = {
        w: {
            "samples_per_second": s / t if t > 0 else None,
            "steps": n,
            "samples": s,
            "tokens_per_second": tok / t if t > 0 and tok else None,
            "global_batch": s / n if n else None,
        }
        for w, (s, t, n, tok) in per.items()
    }
    total_s, total_t = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    total_tok = sum(v[3] for v in per.values())
    return {
        "samples_per_second": total_s / total_t if total_t > 0 else None,
        "tokens_per_second": total_tok / total_t if total_t > 0 and total_tok else None,
        "by_world_size": rows,
    }


def scaling(rows: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Efficiency per world size against the smallest: E = (X_W / W) / (X_b / b) with X the
    samples/s — for b = 1 and a fixed global batch this is T1 / (W * T_W) (strong scaling);
    with a fixed per-rank batch it is T_b / T_W (weak scaling)."""
    known = {w: r for w, r in rows.items() if w and r.get("samples_per_second")}
    if len(known) < 2:
        return []
    base = min(known)
    xb, bb = known[base]["samples_per_second"], known[base]["global_batch"]
    out = []
    for w in sorted(known):
        r = known[w]
        kind = (
            "strong" if r["global_batch"] == bb else "weak" if r["global_batch"] * base == bb * w else "mixed"
        )
        eff = (r["samples_per_second"] / w) / (xb / base)
        out.append(
            {
                "world_size": w,
                "samples_per_second": r["samples_per_second"],
                "kind": kind,
                "global_batch": r["global_batch"],
                "efficiency": round(eff, 4),
            }
        )
    return out


def build_report(run: Run, *, target_loss: float | None = None, others: Sequence[Run] = ()) -> dict[str, Any]:
    """The report as plain JSON-able values (the text and the PNG are drawn from it)."""
    attempts = [Attempt.of(evs) for evs in split_attempts(run.events) if evs]
    progress = [e for a in attempts for e in a.progress]
    if not progress:
        stored = ", ".join(f"step {m.get('step')} (W={m.get('world_size')})" for m in run.manifests)
        raise ReportError(
            f"{run.path}: no progress events: the run never finished a step (or logged none)"
            + (f"; its published checkpoints: {stored}" if stored else "")
        )
    t0, t_end = run.events[0]["time"], run.events[-1]["time"]
    restarts = [_restart(a, b, t0) for a, b in itertools.pairwise(attempts)]
    keep = [b.resumed_step for b in attempts[1:]] + [None]
    productive = sum(s * f for a, k in zip(attempts, keep, strict=True) for _, s, f in _intervals(a, k))
    times, source = _step_times(attempts)
    step_total = sum(times)
    tp = _throughput(attempts)
    rows = dict(tp["by_world_size"])
    for other in others:
        for w, row in _throughput([Attempt.of(e) for e in split_attempts(other.events) if e])[
            "by_world_size"
        ].items():
            rows.setdefault(w, row)
    return {
        "job": progress[-1].get("job"),
        "run_dir": run.path,
        "finished": attempts[-1].finished,
        "steps": max(e["step"] for e in progress),
        "samples_seen": progress[-1].get("samples_seen"),
        "wall_seconds": round(t_end - t0, 3),
        "goodput": goodput(wall_seconds=t_end - t0, productive_seconds=productive),
        "world_sizes": sorted({w for a in attempts for w in a.trained_at}),
        "throughput": tp,
        "step_seconds": _latency(times, source),
        "comm_exposed_seconds": _share(progress, "comm_exposed_seconds", step_total),
        "data_wait_seconds": _share(progress, "data_wait_seconds", step_total),
        "peak_memory_bytes": max((e.get("peak_memory_bytes") or 0 for e in progress), default=0) or None,
        "time_to_target": _time_to_target(progress, target_loss, t0),
        "restarts": [r for r in restarts if r["kind"] != "rerun"],
        "incidents": peer_incidents(run.events, [e for e in run.events if e["event"] in _STEP_DONE], t0),
        "checkpoints": _checkpoints(run, t0),
        "stragglers": _stragglers(run.events),
        "scaling": scaling(rows),
        **_environment(run.run_record or _last_record(run.events)),
        "timeline": _timeline(run.events, attempts, t0),
    }


_STRAGGLER_KEYS = ("rank", "node", "slowdown", "threshold", "first_step", "step", "windows")


def _stragglers(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks the group named as slow (``straggler`` events), in order."""
    return [{k: e.get(k) for k in _STRAGGLER_KEYS} for e in events if e["event"] == "straggler"]


def _latency(times: Sequence[float], source: str) -> dict[str, Any] | None:
    if not times:
        return None
    return {
        "p50": percentile(times, 50),
        "p95": percentile(times, 95),
        "p99": percentile(times, 99),
        "mean": sum(times) / len(times),
        "count": len(times),
        "source": source,
    }


def _share(progress: Sequence[dict[str, Any]], key: str, step_total: float) -> dict[str, Any] | None:
    values = [e[key] for e in progress if isinstance(e.get(key), int | float)]
    if not values:
        return None
    total = sum(values)
    return {"total": total, "fraction_of_step_time": total / step_total if step_total > 0 else None}


def _time_to_target(
    progress: Sequence[dict[str, Any]], target: float | None, t0: float
) -> dict[str, Any] | None:
    if target is None:
        return None
    hit = next((e for e in progress if e.get("loss") is not None and e["loss"] <= target), None)
    if hit is None:
        return {"target_loss": target, "reached": False, "seconds": None, "step": None}
    return {
        "target_loss": target,
        "reached": True,
        "seconds": round(hit["time"] - t0, 3),
        "step": hit["step"],
    }


def _checkpoints(run: Run, t0: float) -> dict[str, Any]:
    published = [e for e in run.events if e["event"] == "checkpoint_published"]
    steps = sorted({e["step"] for e in published})
    gaps = [b - a for a, b in itertools.pairwise(steps)]

    def mean(key: str) -> float | None:
        values = [e[key] for e in published if isinstance(e.get(key), int | float)]
        return sum(values) / len(values) if values else None

    return {
        "published": len(published),
        "aborted": sum(e["event"] == "checkpoint_aborted" for e in run.events),
        "bytes_written": sum(e.get("bytes") or 0 for e in published),
        "persist_seconds_mean": mean("persist_seconds"),
        "blocking_seconds_mean": mean("blocking_seconds"),
        "interval_steps_mean": sum(gaps) / len(gaps) if gaps else None,
        "on_disk": [
            {
                "step": m.get("step"),
                "world_size": m.get("world_size"),
                "bytes": sum(f.get("size", 0) for f in (m.get("files") or {}).values()),
            }
            for m in run.manifests
        ],
    }


def _last_record(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    return next((e for e in reversed(events) if e["event"] == "run_record"), None)


def _environment(record: dict[str, Any] | None) -> dict[str, Any]:
    if record is None:
        return {"precision": None, "precision_table": None, "environment": None}
    keys = (
        "versions", "device", "device_name", "backend", "world_size", "seed", "determinism", "batch", "notes",
    )  # fmt: skip
    return {
        "precision": record.get("precision"),
        "precision_table": record.get("precision_table"),
        "environment": {k: record.get(k) for k in keys if k in record},
    }


def _timeline(events: Sequence[dict[str, Any]], attempts: Sequence[Attempt], t0: float) -> dict[str, Any]:
    """What the PNG draws, times in seconds since the first event."""
    rel = lambda t: round(t - t0, 3)  # noqa: E731
    return {
        "progress": [
            [rel(e["time"]), e["step"], e.get("loss"), e.get("samples_per_second"), i]
            for i, a in enumerate(attempts)
            for e in a.progress
        ],
        "checkpoints": [rel(e["time"]) for e in events if e["event"] == "checkpoint_published"],
        "attempts": [[rel(a.start), rel(a.end), a.world_size, a.finished] for a in attempts],
    }
