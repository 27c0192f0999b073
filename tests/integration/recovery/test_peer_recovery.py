"""Peer recovery end to end, without the trainer: real processes (gloo on CPU, one real etcd)
run tests/integration/recovery/driver.py; a rank is SIGKILLed at a random window; the survivors
keep their processes, re-form with a warm spare or a fresh replacement, receive nothing from
storage (there is none), and finish with the uninterrupted run's digest bit for bit.

The phases (kill -> detect -> formed -> transferred -> first step) are printed, not asserted.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tests.integration.recovery.harness import Job, reference, timeline
from tests.seeds import seeded
from worker.recovery.etcdkv import connect
from worker.recovery.membership import Keys

pytestmark = pytest.mark.integration
WINDOWS = 24


def outcomes(job: Job, pid: int) -> list[dict[str, Any]]:
    return job.events("outcome", pid)


DATA_SEEDS = {2: 11, 3: 23}  # the training's own seed per world size (one reference run each)


@seeded
def test_sigkill_of_a_random_rank(
    tmp_path: Path, etcd: str, references: dict[tuple[Any, ...], dict[str, Any]], seed: int
) -> None:
    """The world size (2 or 3), the replacement (a warm spare or a fresh process), the victim and
    the window of its SIGKILL are all drawn from the fault seed: ``make test`` runs one draw,
    ``make faults`` as many as it has trials. The training's own seed stays per world size."""
    rng = random.Random(f"{seed}-sigkill")
    world, replacement = rng.choice([2, 3]), rng.choice(["spare", "fresh"])
    victim, kill_at = rng.randrange(world), rng.randrange(3, WINDOWS - 4)
    data_seed = DATA_SEEDS[world]
    print(f"seed {seed}: W={world}, SIGKILL rank {victim} in window {kill_at}, {replacement} replacement")
    ref = reference(tmp_path, etcd, references, world=world, windows=WINDOWS, seed=data_seed)
    job = Job(
        tmp_path / "job", etcd, world=world, min_world=world, max_world=world, windows=WINDOWS,
        seed=data_seed,
    )  # fmt: skip
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
    # One incident, recorded by the leader in etcd: what was lost, since when, and how it ended.
    stored = connect(etcd).list_prefix(Keys(job.args["job"]).incidents)
    assert len(stored) == 1, stored
    incident = json.loads(stored[0][1].value)
    assert incident["kind"] == "peer" and incident["lost_launch_ids"] == [f"rank{victim}"], incident
    killed = job.events("killed")[0]["t"]
    assert killed <= incident["failed_at"] <= incident["phases"]["ready"], incident


def test_a_kill_before_the_first_optimizer_step(
    tmp_path: Path, etcd: str, references: dict[tuple[Any, ...], dict[str, Any]]
) -> None:
    """Killed in the very first window: the survivor's optimizer has no state yet, the warm spare's
    has (its warm-up step). The transfer says so and every member drops it, so the first real step
    creates it as in the uninterrupted run: digests equal."""
    ref = reference(tmp_path, etcd, references, world=2, windows=WINDOWS, seed=11)
    job = Job(tmp_path / "job", etcd, world=2, min_world=2, max_world=2, windows=WINDOWS, seed=11)
    try:
        job.start("spare", role="spare", node=2)
        job.wait_for("the spare to stand by", lambda: bool(job.events("spare_standby")))
        job.start("rank0", node=0)
        job.start("rank1", node=1, kill_at=0)
        codes = job.wait_exit()
    finally:
        job.kill_all()
    assert codes == {"spare": 0, "rank0": 0, "rank1": -9}, codes
    spare = next(p for p, name in job.names.items() if name == "spare")
    arrived = outcomes(job, spare)[-1]
    assert arrived["kind"] == "peer" and arrived["version"] == 0 and arrived["bytes"] > 0, arrived
    assert set(job.finished_digests().values()) == {ref["digest"]}
