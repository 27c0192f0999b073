"""Peer recovery under harder faults, end to end with real processes (see test_peer_recovery.py):
the sending survivor killed during the state transfer, a stalled (SIGSTOPped) rank fenced when it
wakes, and two ranks killed at once at W=3 with the group shrinking to one."""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.integration.recovery.harness import Job, reference, timeline
from worker.recovery.plan import sample_counts, superseded_versions

pytestmark = pytest.mark.integration
WINDOWS = 24


def pid_of(job: Job, name: str) -> int:
    return next(p for p, n in job.names.items() if n == name)


def test_kill_of_the_sending_survivor_falls_back_to_the_next(
    tmp_path: Path, etcd: str, references: dict[tuple[Any, ...], dict[str, Any]]
) -> None:
    """W=3: rank 2 dies; its place goes to a spare and rank 0 starts sending; rank 0 dies at its
    second chunk; the next generation takes a second spare, rank 1 sends, and the half-filled
    first spare receives everything again."""
    ref = reference(tmp_path, etcd, references, world=3, windows=WINDOWS, seed=5)
    job = Job(
        tmp_path / "job",
        etcd,
        world=3,
        min_world=3,
        max_world=3,
        windows=WINDOWS,
        seed=5,
        chunk_bytes=1 << 15,
    )
    try:
        for n in (0, 1):
            job.start(f"spare{n}", role="spare", node=3 + n)
        job.wait_for("two spares standing by", lambda: len(job.events("spare_standby")) == 2)
        job.start("rank0", node=0, env={"ELASTRAIN_FAILPOINTS": "peer_send_chunk=kill#2"})
        job.start("rank1", node=1)
        job.start("rank2", node=2, kill_at=9)
        codes = job.wait_exit()
    finally:
        job.kill_all()
    assert codes["rank0"] == -9 and codes["rank2"] == -9, codes
    assert codes["rank1"] == 0 and codes["spare0"] == 0 and codes["spare1"] == 0, codes
    survivor = pid_of(job, "rank1")
    print("phases (ms after the first kill):", timeline(job, [survivor]))
    last = job.events("outcome", survivor)[-1]
    assert last["kind"] == "peer" and last["source_rank"] == 1 and last["rank"] == 1, last
    assert last["attempts"] >= 2 or len(job.events("outcome", survivor)) >= 3, (
        "the second re-formation happened"
    )
    # The spare that held half a state never trained on it: it received again, and every member
    # finishes with the uninterrupted run's state.
    refusals = [e for e in job.events("peer_transfer_refused")]
    assert not refusals, refusals
    assert set(job.finished_digests().values()) == {ref["digest"]}
    assert set(job.finished_digests()) == {"rank1", "spare0", "spare1"}


def test_a_stalled_rank_is_fenced_when_it_wakes(
    tmp_path: Path, etcd: str, references: dict[tuple[Any, ...], dict[str, Any]]
) -> None:
    """W=3, collective timeout 3 s: rank 2 stops itself (SIGSTOP) before window 8; the others time
    out, re-form with the spare and train on; SIGCONT once they trained in the new generation:
    the woken rank is fenced (exit 3) and the survivors' final state is the uninterrupted run's."""
    ref = reference(tmp_path, etcd, references, world=3, windows=WINDOWS, seed=9)
    job = Job(tmp_path / "job", etcd, world=3, min_world=3, max_world=3, windows=WINDOWS, seed=9,
              collective_timeout_s=3.0, step_sleep=0.05)  # fmt: skip
    try:
        job.start("spare", role="spare", node=3)
        job.wait_for("the spare to stand by", lambda: bool(job.events("spare_standby")))
        for n in range(3):
            job.start(f"rank{n}", node=n, stop_at=8 if n == 2 else None)
        stalled = pid_of(job, "rank2")
        job.wait_for("rank 2 to stop", lambda: bool(job.events("stopping", stalled)))
        survivors = [pid_of(job, "rank0"), pid_of(job, "rank1")]
        job.wait_for(
            "the survivors to train in generation 1",
            lambda: all(any(e["generation"] >= 1 for e in job.events("first_step", p)) for p in survivors),
        )
        os.kill(stalled, signal.SIGCONT)
        codes = job.wait_exit()
    finally:
        job.kill_all()
    assert codes == {"spare": 0, "rank0": 0, "rank1": 0, "rank2": 3}, codes
    refused = job.events("recovery_refused", stalled)
    assert refused and refused[-1]["kind"] == "fenced", refused
    assert not job.events("finished", stalled)
    assert set(job.finished_digests().values()) == {ref["digest"]}
    assert set(job.finished_digests()) == {"rank0", "rank1", "spare"}


def test_two_ranks_killed_at_once_shrink_to_one_with_every_sample_once(tmp_path: Path, etcd: str) -> None:
    """W=3, nodes 1:3: ranks 1 and 2 die in the same window; rank 0 goes on alone (no spare, no
    waiting) and the trace shows every sample of both epochs trained exactly once."""
    job = Job(tmp_path / "job", etcd, world=3, min_world=1, max_world=3, epochs=2, seed=13)
    try:
        job.start("rank0", node=0)
        job.start("rank1", node=1, kill_at=6)
        job.start("rank2", node=2, kill_at=6)
        codes = job.wait_exit()
    finally:
        job.kill_all()
    assert codes == {"rank0": 0, "rank1": -9, "rank2": -9}, codes
    survivor = pid_of(job, "rank0")
    print("phases (ms after the kill):", timeline(job, [survivor]))
    last = job.events("outcome", survivor)[-1]
    assert last["kind"] == "peer" and last["world_size"] == 1 and last["rank"] == 0, last
    rows = job.trace()
    counts = sample_counts(rows)
    size = job.args["dataset"]
    assert counts == Counter({(epoch, i): 1 for epoch in (0, 1) for i in range(size)})
    assert len(superseded_versions(rows)) <= last["voided"], "only a voided window is ever trained twice"
    assert {r["world_size"] for r in rows} == {3, 1}
