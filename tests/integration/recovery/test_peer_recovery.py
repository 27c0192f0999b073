"""Peer recovery end to end, without the trainer: real processes (gloo on CPU, one real etcd)
run tests/integration/recovery/driver.py; a rank is SIGKILLed at a random window; the survivors
keep their processes, re-form with a warm spare or a fresh replacement, receive nothing from
storage (there is none), and finish with the uninterrupted run's digest bit for bit.

The phases (kill -> detect -> formed -> transferred -> first step) are printed, not asserted.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.integration.recovery.harness import Job, reference, timeline

pytestmark = pytest.mark.integration
WINDOWS = 24


def outcomes(job: Job, pid: int) -> list[dict[str, Any]]:
    return job.events("outcome", pid)


@pytest.mark.parametrize(("world", "seed"), [(2, 11), (3, 23)])
@pytest.mark.parametrize("replacement", ["spare", "fresh"])
def test_sigkill_of_a_random_rank(
    tmp_path: Path, etcd: str, references: dict[tuple[Any, ...], dict[str, Any]], world: int, seed: int,
    replacement: str,
) -> None:  # fmt: skip
    rng = random.Random(seed)
    victim, kill_at = rng.randrange(world), rng.randrange(3, WINDOWS - 4)
    print(f"seed {seed}: W={world}, SIGKILL rank {victim} in window {kill_at}, {replacement} replacement")
    ref = reference(tmp_path, etcd, references, world=world, windows=WINDOWS, seed=seed)
    job = Job(
        tmp_path / "job", etcd, world=world, min_world=world, max_world=world, windows=WINDOWS, seed=seed
    )
    try:
        if replacement == "spare":
            job.start("spare", role="spare", node=world)
            job.wait_for("the spare to stand by", lambda: bool(job.events("spare_standby")))
        members = {
            n: job.start(f"rank{n}", node=n, kill_at=kill_at if n == victim else None) for n in range(world)
        }
        if replacement == "fresh":  # what the node's agent (or the service) does: start a new process
            members[victim].wait(timeout=240)
            job.start("fresh", node=victim)
        codes = job.wait_exit()
    finally:
        job.kill_all()
    survivors = [p.pid for n, p in members.items() if n != victim]
    print("phases (ms after the kill):", timeline(job, survivors))
    assert codes[f"rank{victim}"] == -9, codes
    assert all(codes[f"rank{n}"] == 0 for n in range(world) if n != victim), codes
    newcomer = "spare" if replacement == "spare" else "fresh"
    assert codes[newcomer] == 0
    digests = job.finished_digests()
    assert set(digests) == {f"rank{n}" for n in range(world) if n != victim} | {newcomer}
    assert set(digests.values()) == {ref["digest"]}, "the recovered run differs from the uninterrupted one"
    for pid in survivors:  # the survivors kept their processes; the state came from one of them
        last = outcomes(job, pid)[-1]
        assert last["kind"] == "peer" and last["voided"] <= 1, last
        assert last["source_rank"] != victim and last["generation"] >= 1
    arrived = outcomes(job, next(p for p, name in job.names.items() if name == newcomer))[-1]
    assert arrived["kind"] == "peer" and arrived["bytes"] > 0 and arrived["rank"] == victim, arrived
    assert {e["layout"] for e in job.events("finished")} == {ref["layout"]}
