"""Peer recovery end to end: the `elastrain serve` console script (embedded etcd, the local TorchX
scheduler), a DDP job in peer mode on 2 nodes of 1 real torchrun worker each, with a warm spare
or without; the test SIGKILLs node 1's worker (or its torchrun agent) mid-run. The survivor
keeps its process, the replacement (the spare, or the worker node 1's agent starts again) gets
the state from the survivor's memory, and the job finishes with the same final checkpoint as an
uninterrupted bare torchrun run of the same training (fp32, and fp16 with a changing loss scale
and dropout); the job record shows one peer recovery and no restart.

Steps are slowed (a failpoint sleep after each gradient sync) only so that the test can find the
job mid-run; the kill itself is a real SIGKILL from outside the worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.demo import alive, parent_pid, worker_pids
from tests.integration.launch import run_worker, write_spec
from tests.integration.worker.test_service_e2e import Service, digest, events_of, job_spec, until
from tests.seeds import seeded, sweeping, swept
from worker.checkpoint.verify import logical_digest

pytestmark = pytest.mark.integration

SLOW = "after_grad_sync=sleep:0.05"


def peer_spec(**over: Any) -> dict[str, Any]:
    """One process per node; one thread each (the service's share of this host's cores), as
    torchrun gives the bare run's two processes (a different thread count adds a matmul's partial
    sums in another order: other bits)."""
    return job_spec(nodes="2", nproc_per_node=1, max_steps=120, recovery={"mode": "peer"}) | over


def workers(launch_id: str) -> list[int]:
    """The pids of the worker processes (not the torchrun agent) of one node app."""
    return worker_pids(launch_id=launch_id)


# fp16 with a loss scale that changes all through the run (2**40 overflows at once and backs
# off; every 4 good steps it grows and overflows again), and a model with dropout: the replaced
# rank's random streams and the scaler must come back exactly from the survivor. Peer mode derives
# the random streams of every window from (seed, version, rank), so with dropout its masks are not
# restart mode's: the reference is then an uninterrupted peer-mode job under the same service.
FP16_DROPOUT = {
    "precision": "fp16",
    "loss_scale": {"init_scale": 2.0**40, "growth_interval": 4},
    "model": {"name": "mlp", "kwargs": {"hidden": 32, "norm": "layer", "dropout": 0.1}},
}
VARIANTS: dict[str, dict[str, Any]] = {"fp32": {}, "fp16-dropout": FP16_DROPOUT}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final checkpoint digest of the same training on a bare torchrun (2 processes)."""
    tmp = tmp_path_factory.mktemp("bare-peer")
    spec = peer_spec(nodes="1", nproc_per_node=2, recovery={"mode": "restart"}, env={})
    spec["checkpoint"] = spec["checkpoint"] | {"dir": str(tmp / "ck")}
    run = run_worker(write_spec(tmp, spec), nproc=2)
    assert run.code == 0, run.stderr[-3000:]
    return digest(tmp / "ck")


def reference(service: Service, variant: str) -> str | None:
    """Submit an uninterrupted run of ``variant`` when its reference is not the bare run (see
    FP16_DROPOUT); it trains next to the job under test. Returns its job id."""
    return service.submit(peer_spec() | VARIANTS[variant]) if VARIANTS[variant] else None


def reference_digest(service: Service, job_id: str | None, bare: str) -> str:
    """What an uninterrupted run ends with: the reference job's final checkpoint, or the bare run's."""
    if job_id is None:
        return bare
    final = service.finished(job_id)
    assert final["state"] == "SUCCEEDED" and not final["recoveries"], final["events"][-12:]
    return digest(Path(final["checkpoint_dir"]))


def start(tmp_path: Path, failpoints: str) -> Service:
    svc = Service(tmp_path / "svc", {"ELASTRAIN_FAILPOINTS": failpoints})
    svc.data_dir.mkdir()
    svc.start()
    return svc


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    svc = start(tmp_path, SLOW)
    yield svc
    svc.stop()


def kill_and_finish(
    service: Service, job_id: str, *, agent: bool = False, at: int = 15, node: int = 1
) -> tuple[dict[str, Any], float, float]:
    """SIGKILL node ``node``'s worker (or, with ``agent``, its torchrun agent) ``at`` steps in;
    the survivor (the other node's worker) keeps its process through the recovery, and the
    victim's worker is gone by the repaired group's first step. The run's event log (what
    ``elastrain report`` reads) holds that one incident, whichever rank led the recovery.
    Returns the finished job, the time of the kill and the time this test saw the victim's
    worker gone."""
    survivor, victim = f"{job_id}-n{1 - node}-a0", f"{job_id}-n{node}-a0"
    until(lambda: (service.job(job_id)["step"] or 0) >= at, f"the job {at} steps in", 300)
    (survivor_pid,) = until(lambda: workers(survivor), "the survivor's worker", 30)
    (victim_pid,) = until(lambda: workers(victim), "the victim's worker", 30)
    target = parent_pid(victim_pid) if agent else victim_pid
    assert target is not None, "the victim's worker ended before the kill"
    killed_at = time.time()
    os.kill(target, signal.SIGKILL)
    deadline = killed_at + 60
    while alive(victim_pid) and time.time() < deadline:  # when the victim's worker ends, to 2 ms
        time.sleep(0.002)
    gone_at = time.time()
    repaired = lambda: (r := service.job(job_id)["recoveries"]) and r[0]["first_step_at"]  # noqa: E731
    until(repaired, "the repaired group's first step", 120)
    assert not alive(victim_pid), "the lost node's worker still runs after the group was repaired"
    os.kill(survivor_pid, 0)  # the survivor kept its process (raises if it is gone)
    final = service.finished(job_id)
    assert final["state"] == "SUCCEEDED", (final["events"][-12:], service.node_logs(job_id)[-4000:])
    (recovery,) = final["recoveries"]
    assert victim in recovery["lost"] and recovery["failed_at"] >= killed_at - 1, recovery
    assert final["restarts"] == 0, final["events"][-12:]
    incidents = events_of(Path(final["checkpoint_dir"]) / "events.jsonl", "recovery_incident")
    assert [i["lost_launch_ids"] for i in incidents] == [[victim]], incidents
    return final, killed_at, gone_at


@pytest.mark.parametrize(
    ("spares", "variant", "node"),
    [(0, "fp32", 0), (1, "fp16-dropout", 1)],
    ids=["respawned", "spare-fp16-dropout"],
)  # fp32 with a spare: the agent-kill test below (its worker dies with its agent)
def test_a_killed_worker_is_replaced_from_peer_memory(
    service: Service, uninterrupted: str, spares: int, variant: str, node: int
) -> None:
    """With a spare, the spare takes the lost slot; without, the lost node's own torchrun agent
    starts its worker again and the group waits for it (a fixed size: ``nodes`` "2"). Without a
    spare the victim is rank 0: its replacement takes rank 0 again (the numerics contract), so
    the recovery's leader -- the survivor, which reports it -- is rank 1."""
    reference_id = reference(service, variant)
    job_id = service.submit(peer_spec(spares=spares) | VARIANTS[variant])
    final, _, _ = kill_and_finish(service, job_id, node=node)
    expected = reference_digest(service, reference_id, uninterrupted)
    (recovery,) = final["recoveries"]
    assert recovery["kind"] == "peer", recovery
    assert recovery["bytes_from_peers"] > 0 and not recovery["bytes_from_storage"], recovery
    members = {n["index"]: n["launch_id"] for n in final["nodes"] if n["role"] == "member"}
    assert members[node] == f"{job_id}-n{2 if spares else node}-a0", final["nodes"]
    assert digest(Path(final["checkpoint_dir"])) == expected
    # The run record is whole, also when rank 0's replacement (which never started the run) wrote it.
    record = json.loads((Path(final["checkpoint_dir"]) / "run-record.json").read_text())
    assert record["spec_hash"] and record["world_size"] == 2 and record["generation"] >= 1, sorted(record)
    assert record["gc"]["enabled"] is True, record["gc"]  # a peer-mode process turned it on again
    # One-process node apps, nothing in the job's env: the service gave each worker its share.
    threads = record["threads"]
    assert (
        threads["decided_by"].startswith("the service") and "ELASTRAIN_LOCAL_SLOTS" in threads["decided_by"]
    )
    assert threads["intra_op"] == int(threads["OMP_NUM_THREADS"]), threads


@seeded
def test_a_killed_agent_is_one_recovery_timed_from_the_kill(
    service: Service, uninterrupted: str, seed: int
) -> None:
    """Node 1's torchrun agent is SIGKILLed, not its worker: the orphaned worker stops (it must
    not train on with the survivor), the spare takes its place from the survivor's memory, and
    the job record holds one peer recovery whose time agrees within 10% with the time this test
    measures from the kill to the repaired group's first step.

    The record starts at the agent's death as its orphan saw it: the orphan's lifeline looks at
    /proc/<agent>/stat, where a pending SIGKILL shows the moment kill() returns, and says ``bye``
    over its control connections before the process stops, with the middle of its last look
    that found the agent alive and its first that found it dying (worker/start/lifeline.py). History
    of this 10%: the record once started when the agent's pidfd became readable, after the
    kernel had torn the agent's memory down (44 ms late on a loaded CI machine); then at the
    orphan's last live look, 2-24 ms early with a CPU hog beside the job, but 36 ms early on a
    loaded CI machine (the looks are up to 50 ms apart while the training thread glances, more
    when the process waits for a CPU), which broke the 10% again; the middle is off by at most
    half that gap."""
    job_id = service.submit(peer_spec(spares=1))
    at = random.Random(f"{seed}-agent").randrange(10, 60)  # the kill's step, from the fault seed
    final, killed_at, gone_at = kill_and_finish(service, job_id, agent=True, at=at)
    (recovery,) = final["recoveries"]
    assert recovery["kind"] == "peer" and recovery["steps_lost"] == 0, recovery
    since = {k: round(recovery[k] - killed_at, 3) for k in ("failed_at", "detected_at", "first_step_at")}
    print(f"after the kill (s): orphan gone {gone_at - killed_at:.3f},", since, "phases:", recovery["phases"])
    measured = recovery["first_step_at"] - killed_at
    assert abs(recovery["seconds"] - measured) <= 0.1 * measured, (since, recovery)
    assert digest(Path(final["checkpoint_dir"])) == uninterrupted


def test_a_corrupt_transfer_falls_back_to_the_checkpoint_in_process(
    tmp_path: Path, uninterrupted: str
) -> None:
    """The spare's first received chunk has a byte flipped (failpoint ``peer_receive_chunk``):
    the members' digests disagree, nobody trains on it, and every member restores the newest
    checkpoint in its own process -- a ``storage`` recovery, still no restart, same final state."""
    service = start(tmp_path, f"{SLOW},peer_receive_chunk=corrupt#1")
    try:
        job_id = service.submit(peer_spec(spares=1))
        final, _, _ = kill_and_finish(service, job_id)
    finally:
        service.stop()
    assert "elastrain failpoint peer_receive_chunk: corrupt" in service.node_logs(job_id)
    (recovery,) = final["recoveries"]
    assert recovery["kind"] == "storage" and recovery["bytes_from_storage"] > 0, recovery
    assert digest(Path(final["checkpoint_dir"])) == uninterrupted


def test_a_loss_while_a_save_waits_for_the_service_ends_the_wait(tmp_path: Path, uninterrupted: str) -> None:
    """Node 1's worker is SIGKILLed while both ranks hold their step-20 save's report (failpoint
    ``before_report``, 3 s, the second save of each process). The survivor then reports and waits
    for the service's answer, which cannot come (the victim never reports): it stops waiting as
    soon as it knows the group lost a member (its control connection ended), not after the
    collective timeout (60 s, when the save's wait was blind to the loss), the save is aborted
    with that reason, and the spare takes the slot from the survivor's memory."""
    service = start(tmp_path, f"{SLOW},before_report=sleep:3#2")
    try:
        job_id = service.submit(peer_spec(spares=1))
        paused = lambda: "elastrain failpoint before_report: sleep" in service.node_logs(job_id)  # noqa: E731
        until(paused, "the step-20 save's reports held", 300)
        final, _, _ = kill_and_finish(service, job_id, at=0)
    finally:
        service.stop()
    aborted = events_of(Path(final["checkpoint_dir"]) / "events.jsonl", "checkpoint_aborted")
    reasons = [a["reason"] for a in aborted]
    assert any(r.startswith("the group lost") for r in reasons), reasons
    assert not any("no answer from the service" in r for r in reasons), reasons
    (recovery,) = final["recoveries"]
    assert recovery["kind"] == "peer", recovery
    assert digest(Path(final["checkpoint_dir"])) == uninterrupted


@seeded
def test_a_stopped_worker_is_named_with_the_last_step_it_completed(
    tmp_path: Path, uninterrupted: str, seed: int
) -> None:
    """A node's worker is SIGSTOPped (not killed: its process and its connections stay) while
    both workers hold in a window drawn from the seed: node 1's in ``make test``; under
    ``make faults`` (``ELASTRAIN_FAULT_SWEEP=1``) the seed draws node 0 too, the group's leader,
    whose step the survivor knows from the leader's beacon (that recovery waits until the service
    ends the stopped node: about a minute longer). The survivor's collective times out
    (``recovery.collective_timeout_s``), the spare takes the slot from the survivor's memory, and
    the recovery -- its ``recovery`` events and the service's incident -- names the stopped rank
    and the last step it completed, the step before that window, as its beacon last said. Woken
    after the repair, the stopped worker is fenced (or already gone with its node) and the job
    ends with the uninterrupted run's state."""
    rng = random.Random(f"{seed}-stop")
    node, window = rng.randrange(2) if sweeping() else 1, rng.randrange(15, 40)
    what = f"seed={seed}: node {node} stopped in window {window}"
    service = start(tmp_path, f"after_grad_sync=sleep:5#{window}^0,{SLOW}")  # first attempts hold 5 s
    try:
        job_id = service.submit(peer_spec(spares=1, recovery={"mode": "peer", "collective_timeout_s": 8}))
        victim = f"{job_id}-n{node}-a0"
        (victim_pid,) = until(lambda: workers(victim), f"the victim's worker; {what}", 120)
        holding = f"elastrain failpoint after_grad_sync: sleep:5 (pid {victim_pid})"
        until(lambda: holding in service.node_logs(job_id), f"the victim holding; {what}", 300)
        time.sleep(1.5)  # past one beacon period (1 s) inside the hold: its beacon said the step
        os.kill(victim_pid, signal.SIGSTOP)
        try:
            repaired = lambda: (r := service.job(job_id)["recoveries"]) and r[0]["first_step_at"]  # noqa: E731
            until(repaired, f"the repaired group's first step; {what}", 120)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the service may have stopped its node
                os.kill(victim_pid, signal.SIGCONT)
        final = service.finished(job_id)
    finally:
        service.stop()
    assert final["state"] == "SUCCEEDED", (what, final["events"][-12:], service.node_logs(job_id)[-4000:])
    (recovery,) = final["recoveries"]
    assert recovery["kind"] == "peer" and victim in recovery["lost"], (what, recovery)
    named = {str(node): window - 1}
    assert recovery["lost_ranks"] == [node] and recovery["last_completed_steps"] == named, (what, recovery)
    reports = events_of(Path(final["checkpoint_dir"]) / "events.jsonl", "recovery")
    assert reports and all(r["last_completed_steps"] == named for r in reports), (what, reports)
    assert digest(Path(final["checkpoint_dir"])) == uninterrupted, what


BITFLIP = "tests.integration.worker.bitflip:mlp"
WHEN_FLIPPED = ["between saves", "before the first save"]


def three_replicas(**flip: Any) -> dict[str, Any]:
    """A peer-mode job of three replicas (one node of three processes: torchrun's ``RANK`` is the
    group's rank) of a team's model that may flip a bit (:mod:`tests.integration.worker.bitflip`)."""
    model = {"factory": BITFLIP, "kwargs": {"hidden": 32, "norm": "layer", **flip}}
    over = {"nodes": "1", "nproc_per_node": 3, "max_steps": 30, "integrity": {"every_steps": 4}}
    return peer_spec(model=model) | over


@seeded
@pytest.mark.parametrize("when", swept(WHEN_FLIPPED), ids=lambda w: w or "drawn")
def test_a_flipped_bit_in_one_of_three_replicas_is_trained_away_in_process(
    service: Service, tmp_path: Path, seed: int, when: str | None
) -> None:
    """One rank's model (drawn from the seed) flips a bit of a weight at a training forward
    drawn from the seed (the settling of DDP counts a few). Between saves (after the save of
    step 10): caught by the comparison before the save of step 20 at the latest; the next
    comparison names that rank and the weight; nothing is saved while the replicas disagree;
    the group re-forms without a restart and restores the newest checkpoint in process (a
    ``storage`` recovery: the majority's state took gradients computed from the corrupt replica,
    so no memory holds the undisturbed run's state). Before the first save there is nothing to
    restore: the workers exit and torchrun's restart trains from the seed (one restart). Either
    way the steps since are trained again and the job ends, and publishes every checkpoint, as
    an undisturbed job of the same training."""
    rng = random.Random(f"{seed}-flip")
    when = when or rng.choice(WHEN_FLIPPED)
    early = when == "before the first save"
    steps_drawn = (3, 7) if early else (14, 17)
    rank, call, tensor = rng.randrange(3), 2 * rng.randrange(*steps_drawn) - 1, "net.0.weight"
    what = f"seed={seed}: rank {rank} flips a bit at its forward {call}, {when}"
    reference_id = service.submit(three_replicas())
    flip = {"flip_rank": rank, "flip_call": call, "flip_tensor": tensor, "marker": str(tmp_path / "flipped")}
    job_id = service.submit(three_replicas(**flip))
    final, reference = service.finished(job_id), service.finished(reference_id)
    logs = service.node_logs(job_id)[-4000:]
    assert final["state"] == reference["state"] == "SUCCEEDED", (what, final["events"][-12:], logs)
    assert (tmp_path / "flipped").exists(), f"{what}: the model never flipped its bit"
    ck, ref_ck = Path(final["checkpoint_dir"]), Path(reference["checkpoint_dir"])
    (caught,) = events_of(ck / "events.jsonl", "replica_mismatch")
    assert caught["ranks"] == [rank] and caught["tensors"] == [tensor], (what, caught)
    (recovery,) = final["recoveries"]
    if early:
        assert caught["step"] <= 10, (what, caught)  # at 10: the comparison before the first save
        assert recovery["kind"] == "restart" and recovery["resumed_step"] == 0, (what, recovery)
        assert final["restarts"] == 1, (what, final["events"][-12:])
    else:
        assert 10 < caught["step"] <= 20, (what, caught)  # at 20: the comparison before that save
        assert recovery["kind"] == "storage" and recovery["lost_ranks"] == [rank], (what, recovery)
        assert final["restarts"] == 0, (what, final["events"][-12:])
    assert not reference["recoveries"], (what, reference["recoveries"])
    assert digest(ck) == digest(ref_ck), what
    steps = lambda root: {p.name: logical_digest(p) for p in sorted(root.glob("step-*"))}  # noqa: E731
    assert steps(ck) == steps(ref_ck) and "step-00000030" in steps(ck), what
