"""Peer recovery under harder faults, end to end with real processes (see test_peer_recovery.py):
the sending survivor killed during the state transfer, a stalled (SIGSTOPped) rank fenced when it
wakes, and two ranks killed at once at W=3 with the group shrinking to one."""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.integration.recovery.harness import Job, reference, timeline
from tests.seeds import seeded
from worker.recovery.plan import sample_counts, superseded_versions

pytestmark = pytest.mark.integration
WINDOWS = 24


def pid_of(job: Job, name: str) -> int:
    return next(p for p, n in job.names.items() if n == name)


KILL_IN_TRANSFER = {
    "sender": ("rank0", "peer_send_chunk=kill#2"),
    "receiver": ("spare0", "peer_receive_chunk=kill#2"),
}


@seeded
@pytest.mark.parametrize("who", ["sender", "receiver"])
def test_kill_during_the_state_transfer(
    tmp_path: Path, etcd: str, references: dict[tuple[Any, ...], dict[str, Any]], who: str, seed: int
) -> None:
    """W=3: rank 2 dies in a window drawn from the seed; its place goes to the first spare and
    rank 0 starts sending. Then the sender (rank 0) or the receiver (that spare) dies at its
    second chunk. The next generation takes the second spare; the next survivor (rank 1) sends
    when rank 0 is gone, and whoever holds half a state receives everything again: the
    uninterrupted run's digest at the end."""
    kill_at = random.Random(f"{seed}-transfer-{who}").randrange(4, WINDOWS - 6)
    ref = reference(tmp_path, etcd, references, world=3, windows=WINDOWS, seed=5)
    job = Job(tmp_path / "job", etcd, world=3, min_world=3, max_world=3, windows=WINDOWS, seed=5,
              chunk_bytes=1 << 15)  # fmt: skip
    victim, failpoint = KILL_IN_TRANSFER[who]
    armed = {"ELASTRAIN_FAILPOINTS": failpoint}
    try:
        job.start("spare0", role="spare", node=3, env=armed if who == "receiver" else {})
        job.wait_for("the first spare standing by", lambda: len(job.events("spare_standby")) == 1)
        job.start("spare1", role="spare", node=4)
        job.wait_for("two spares standing by", lambda: len(job.events("spare_standby")) == 2)
        gate = {"spares_by": [kill_at - 1, 2]}  # both spares connected before the kill: spare0 first
        job.wait_leading(job.start("rank0", node=0, env=armed if who == "sender" else {}, **gate))
        job.start("rank1", node=1, **gate)  # rank 0 leads: the spares it gated for are the ones it picks
        job.start("rank2", node=2, kill_at=kill_at, **gate)
        codes = job.wait_exit()
    finally:
        job.kill_all()
    assert job.events("spares_connected"), codes
    assert codes[victim] == -9 and codes["rank2"] == -9, (codes, job.events("recovery_decided"))
    alive = {"rank0", "rank1", "spare0", "spare1"} - {victim}
    assert all(codes[name] == 0 for name in alive), codes
    survivor = pid_of(job, "rank1")
    print(f"phases (ms after the first kill), {who} killed:", timeline(job, [survivor]))
    last = job.events("outcome", survivor)[-1]
    assert last["kind"] == "peer" and last["attempts"] >= 2, last  # one incident, a second attempt
    assert last["source_rank"] == (1 if who == "sender" else 0), last
    assert not job.events("peer_transfer_refused")
    assert set(job.finished_digests()) == alive
    assert set(job.finished_digests().values()) == {ref["digest"]}


@seeded
def test_a_corrupt_chunk_is_never_trained_on(tmp_path: Path, etcd: str, seed: int) -> None:
    """A byte flipped in a chunk (the first or the second, drawn from the seed) on its way to the
    spare: the digest check refuses it, no member accepts the transfer, and all fall back to the
    storage checkpoint (here: they stop, exit 5)."""
    rng = random.Random(f"{seed}-corrupt")
    kill_at, chunk = rng.randrange(3, WINDOWS - 4), rng.choice([1, 2])
    job = Job(tmp_path / "job", etcd, world=2, min_world=2, max_world=2, windows=WINDOWS, seed=7,
              chunk_bytes=1 << 15)  # fmt: skip
    try:
        corrupt = {"ELASTRAIN_FAILPOINTS": f"peer_receive_chunk=corrupt#{chunk}"}
        spare = job.start("spare", role="spare", node=2, env=corrupt)
        job.wait_for("the spare to stand by", lambda: bool(job.events("spare_standby")))
        job.start("rank0", node=0)
        job.start("rank1", node=1, kill_at=kill_at)
        codes = job.wait_exit()
    finally:
        job.kill_all()
    assert codes == {"spare": 5, "rank0": 5, "rank1": -9}, codes
    for pid in (spare.pid, pid_of(job, "rank0")):
        last = job.events("outcome", pid)[-1]
        assert last["kind"] == "storage" and "verified" in last["reason"], last
    assert not job.events("first_step", spare.pid), "the spare trained on a state it could not verify"
    assert not job.events("finished")


@seeded
def test_a_stalled_rank_is_fenced_when_it_wakes(
    tmp_path: Path, etcd: str, references: dict[tuple[Any, ...], dict[str, Any]], seed: int
) -> None:
    """W=3, collective timeout 3 s: rank 2 stops itself (SIGSTOP) before a window drawn from the
    seed; the others time out, re-form with the spare and train on; SIGCONT once they trained in
    the new generation: the woken rank is fenced (exit 3) and the survivors' final state is the
    uninterrupted run's."""
    stop_at = random.Random(f"{seed}-sigstop").randrange(4, WINDOWS - 8)
    ref = reference(tmp_path, etcd, references, world=3, windows=WINDOWS, seed=9)
    job = Job(tmp_path / "job", etcd, world=3, min_world=3, max_world=3, windows=WINDOWS, seed=9,
              collective_timeout_s=3.0, step_sleep=0.05)  # fmt: skip
    try:
        job.start("spare", role="spare", node=3)
        job.wait_for("the spare to stand by", lambda: bool(job.events("spare_standby")))
        for n in range(3):
            job.start(f"rank{n}", node=n, stop_at=stop_at if n == 2 else None)
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


@seeded
def test_two_ranks_killed_at_once_shrink_to_one(tmp_path: Path, etcd: str, seed: int) -> None:
    """W=3, nodes 1:3: ranks 1 and 2 die in the same window (drawn from the seed); rank 0 goes on
    alone (no spare, no waiting) and the trace shows every sample of both epochs trained exactly
    once."""
    kill_at = random.Random(f"{seed}-two").randrange(2, 9)
    job = Job(tmp_path / "job", etcd, world=3, min_world=1, max_world=3, epochs=2, seed=13)
    try:
        job.start("rank0", node=0)
        job.start("rank1", node=1, kill_at=kill_at)
        job.start("rank2", node=2, kill_at=kill_at)
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
