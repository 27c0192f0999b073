"""The in-job coordinator protocol with ranks as threads over an in-memory store.

No wall clock decides anything here: rank 0's report deadline runs on a clock the test holds
(``InJobCoordinator(clock=...)``), so whether it has passed depends on what the ranks did, never
on how fast the threads ran.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path

from tests.unit.checkpoint.synth import TENSORS, reports_for
from worker.checkpoint.commit import Report
from worker.checkpoint.coordinator import InJobCoordinator, MemoryStore, Outcome, store_allgather
from worker.checkpoint.layout import list_published, read_latest, staging_dir_name

STOPPED = 0.0  # a clock that never moves: the deadline never passes
PASSED = 1e12  # past any deadline


class DeadlineAfter:
    """A clock for rank 0: the deadline passes only once ``ranks`` have all reported and rank 0
    has looked at the clock once since (so it has read their reports in the pass before)."""

    def __init__(self, ranks: set[int]) -> None:
        self.waiting = set(ranks)
        self.reported: set[int] = set()
        self.lock = threading.Lock()
        self.seen_all = False

    def reported_by(self, rank: int) -> None:
        with self.lock:
            self.reported.add(rank)

    def __call__(self) -> float:
        with self.lock:
            if not self.waiting <= self.reported:
                return STOPPED
            if not self.seen_all:
                self.seen_all = True
                return STOPPED
            return PASSED


def _run(
    tmp_path: Path, reports: list[Report | None], *, clock: Callable[[], float] = lambda: STOPPED
) -> list[Outcome]:
    store = MemoryStore()
    world = len(reports)
    staging = tmp_path / staging_dir_name(10, 0)
    staging.mkdir()
    _, files, _ = reports_for(TENSORS, world, block_size=16)
    for name, data in files.items():
        (staging / name).write_bytes(data)
    outcomes: list[Outcome | None] = [None] * world

    def rank(r: int) -> None:
        co = InJobCoordinator(store, rank=r, world_size=world, job="j", job_dir=tmp_path, clock=clock)
        report = reports[r]
        if report is not None:
            co.report(report, seq=1)
            if isinstance(clock, DeadlineAfter):
                clock.reported_by(r)
        outcomes[r] = co.outcome(10, 0, seq=1, timeout=5.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(o is not None for o in outcomes), "a rank never learned the outcome"
    return outcomes  # type: ignore[return-value]


def test_all_report_then_everyone_learns_published(tmp_path: Path) -> None:
    reports = reports_for(TENSORS, 3, block_size=16)[0]
    outcomes = _run(tmp_path, list(reports))
    assert all(o.published and o.step == 10 for o in outcomes)
    assert len({o.path for o in outcomes}) == 1
    assert [s for s, _ in list_published(tmp_path)] == [10] and read_latest(tmp_path) == "step-00000010"


def test_missing_rank_aborts_after_timeout_and_staging_is_removed(tmp_path: Path) -> None:
    reports: list[Report | None] = list(reports_for(TENSORS, 3, block_size=16)[0])
    reports[2] = None
    outcomes = _run(tmp_path, reports, clock=DeadlineAfter({0, 1}))
    assert not any(o.published for o in outcomes[:2])
    assert "ranks [2]" in outcomes[0].reason and outcomes[1].reason == outcomes[0].reason
    assert list_published(tmp_path) == [] and not (tmp_path / staging_dir_name(10, 0)).exists()


def test_failure_report_aborts_without_waiting(tmp_path: Path) -> None:
    reports: list[Report | None] = list(reports_for(TENSORS, 3, block_size=16)[0])
    reports[1] = Report(10, 0, 1, 3, ok=False, error="OSError: [Errno 28] No space left on device")
    # The clock never moves: only the failure report can end the wait (waiting for the
    # deadline would leave every rank without an outcome, and _run fails saying so).
    outcomes = _run(tmp_path, reports, clock=lambda: STOPPED)
    assert all(not o.published and "rank 1" in o.reason for o in outcomes)
    assert "No space left" in outcomes[0].reason and not (tmp_path / staging_dir_name(10, 0)).exists()


def test_file_on_disk_shorter_than_reported_aborts(tmp_path: Path) -> None:
    reports = list(reports_for(TENSORS, 2, block_size=16)[0])
    big = dataclasses.replace(reports[1].files["rank-00001.bin"], size=10**6)
    reports[1] = dataclasses.replace(reports[1], files={"rank-00001.bin": big})
    outcomes = _run(tmp_path, list(reports))
    assert not outcomes[0].published


def test_store_allgather() -> None:
    store = MemoryStore()
    results: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        results[r] = store_allgather(store, "p", rank=r, world_size=3, value=f"v{r}", timeout=5)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {r: ["v0", "v1", "v2"] for r in range(3)}


def test_sessions_keep_successive_checkpointers_apart() -> None:
    from worker.checkpoint.coordinator import session_id

    store = MemoryStore()
    first = [session_id(store, job="j", generation=0, world_size=3) for _ in range(3)]
    second = [session_id(store, job="j", generation=0, world_size=3) for _ in range(3)]
    assert first == ["s0"] * 3 and second == ["s1"] * 3
    assert session_id(store, job="j", generation=1, world_size=3) == "s0"
    assert store.delete_key("elastrain/ckpt/j/g0/sessions") and not store.check(
        ["elastrain/ckpt/j/g0/sessions"]
    )
