"""Reading what the workers' data paths loaded (ELASTRAIN_TRACE_SAMPLES, see worker.datapath.trace)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from tests.integration.launch import Run
from worker.datapath.trace import rng_fingerprint


def trace_rows(directory: Path) -> list[dict[str, Any]]:
    """Every window line of every rank (with its ``rank``), file by file."""
    rows = []
    for path in sorted(directory.glob("rank-*.jsonl")):
        rank = int(path.name.split("-")[1])
        rows += [json.loads(line) | {"rank": rank} for line in path.read_text().splitlines()]
    return rows


def committed(directory: Path) -> Counter[tuple[int, int]]:
    """(epoch, index) counts of the committed history: for each step, the newest generation's
    windows (a failure rolls back the windows after the checkpoint it resumes from)."""
    rows = trace_rows(directory)
    newest: dict[int, int] = {}
    for row in rows:
        newest[row["step"]] = max(newest.get(row["step"], -1), row["generation"])
    seen: Counter[tuple[int, int]] = Counter()
    for row in rows:
        if row["generation"] == newest[row["step"]]:
            seen.update((row["epoch"], i) for i in row["indices"])
    return seen


def assert_rng_continued(run: Run, trace: Path, ref_trace: Path, why: str) -> None:
    """Right before the first window after the resume, every rank's generators are exactly what
    the checkpoint restored, and what the uninterrupted run had at that step."""
    resumed = run.last("resumed")
    generation = run.last("run_record")["generation"]
    manifest = json.loads((Path(resumed["checkpoint"]) / "manifest.json").read_text())
    at = (generation, resumed["step"])
    first = {r["rank"]: r["rng"] for r in trace_rows(trace) if (r["generation"], r["step"]) == at}
    expected = {r["rank"]: r["rng"] for r in trace_rows(ref_trace) if r["step"] == resumed["step"]}
    restored = {int(rank): rng_fingerprint(meta["rng"]) for rank, meta in manifest["rank_meta"].items()}
    assert sorted(first) == sorted(restored), f"{why}: no trace of the first window after the resume"
    assert first == restored, f"{why}: a generator drew between the RNG restore and the first step"
    assert first == expected, f"{why}: the restored generators are not the uninterrupted run's"
