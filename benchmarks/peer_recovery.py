"""Recovery without a restart against torchrun's restart, side by side in one run.

The same job under a real ``elastrain serve`` (2 nodes x 1 process, the benchmark MLP, a
checkpoint every 50 steps), twice a round in alternating order (restart, peer; peer, restart):

- ``recovery.mode: restart``: one worker is SIGKILLed after the first checkpoint; torchrun
  stops the survivors, the group re-forms, fresh processes import torch and load the newest
  checkpoint, and the steps since it are trained again.
- ``recovery.mode: peer`` (with ``--spares`` warm spares, default 1): the same kill; the
  survivor keeps its process, a spare (or a replacement) takes the lost place and receives the
  state from the survivor's memory.

Each round reads the job record's recovery (the workers' own measurements) and prints the time
from the kill to the first step of the repaired group, the steps trained again (the newest step
reported before the kill minus the step the group resumed from: a lower bound, progress comes
every 10 steps) and the recovery's kind. Prints the medians with
their spread and the ratio peer / restart (target <= 0.25). ``--steady N`` also runs a job of N
steps without a fault in each mode (alternating) and prints samples/s peer / restart (what peer
mode costs a step; target >= 0.98): over each whole run, and from each run's median 10-step
interval (its progress events), which a burst of this machine's noise in a few intervals does
not move. Runs of one mode differ here by up to ~30% between rounds on the whole-run rate.

``--control`` adds a third fault-free job to each steady round, a second restart-mode one (an
A/A control: the same mode twice), the three in an order that rotates from round to round. Both
ratios, peer / restart and restart / restart, are then given per round, with the geometric mean
over the rounds and its 95% bootstrap interval (:func:`geomean_interval`): the control's interval
is what this machine can resolve with that many rounds -- a comparison of a mode with itself,
which must hold 1 -- and the target is met when peer's interval lies at or above 0.98, missed
when it lies below, and not settled by the run when it holds 0.98.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import emit
from benchmarks.service_job import events_of, interval_rate, rate, serving
from benchmarks.service_job import spec as base_spec
from benchmarks.stats import geomean_interval, rotation, spread, verdict
from tests.integration.worker.test_service_e2e import Service, until
from tests.integration.worker.test_service_peer import workers


def spec(mode: str, spares: int, **over: Any) -> dict[str, Any]:
    body = base_spec(nodes="2", nproc_per_node=1, recovery={"mode": mode}, **over)
    return body | ({"spares": spares} if mode == "peer" else {})


def one_recovery(svc: Service, mode: str, spares: int, steps: int = 1500) -> dict[str, Any]:
    """SIGKILL node 1's worker (a member: never the spare) a little past the first checkpoint (step
    100) of a job of ``steps`` steps."""
    body = spec(
        mode, spares, max_steps=steps, checkpoint={"interval_steps": 100, "retention": {"keep_latest": 50}}
    )
    job_id = svc.submit(body)
    until(lambda: (svc.job(job_id)["last_published_step"] or 0) >= 100, "a checkpoint", 600)
    time.sleep(0.5)  # steps past the checkpoint: the restart path trains them again
    (victim,) = until(lambda: workers(f"{job_id}-n1-a0"), "node 1's worker", 60)
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    job = svc.finished(job_id, timeout=900)
    assert job["state"] == "SUCCEEDED", job
    recoveries = [r for r in job.get("recoveries", []) if r.get("first_step_at")]
    assert recoveries, f"{mode}: no completed recovery in the job record: {job.get('recoveries')}"
    rec = recoveries[0]
    events = events_of(Path(job["checkpoint_dir"]) / "events.jsonl")
    before = max(e["step"] for e in events if e["event"] == "progress" and e["time"] < killed)
    resumed = rec.get("resumed_step")
    return {
        "kind": rec.get("kind"),
        "seconds": float(rec["first_step_at"]) - killed,
        "lost_steps": max(0, before - int(resumed)) if resumed is not None else None,
        "bytes_from_storage": rec.get("bytes_from_storage"),
        "recoveries": len(job.get("recoveries", [])),
        "restarts": job.get("restarts"),
    }


def steady(svc: Service, mode: str, spares: int, steps: int) -> tuple[float, float]:
    """A fault-free job's samples/s: over the whole run, and the median of its 10-step intervals."""
    job_id = svc.submit(spec(mode, spares, max_steps=steps))
    job = svc.finished(job_id, timeout=900)
    assert job["state"] == "SUCCEEDED", job
    events = events_of(Path(job["checkpoint_dir"]) / "events.jsonl")
    return rate(events), interval_rate(events)


def report_recoveries(results: dict[str, list[dict[str, Any]]], spares: int) -> None:
    restart = [r["seconds"] for r in results["restart"]]
    peer = [r["seconds"] for r in results["peer"]]
    lost = {mode: [r["lost_steps"] for r in results[mode]] for mode in results}
    print(f"recovery after a worker SIGKILL (W=2, 2 nodes x 1 process; peer with {spares} spare(s))")
    print(
        f"  restart: kill -> first step s {spread(restart)}; steps trained again (at least) {lost['restart']}"
    )
    print(f"  peer:    kill -> first step s {spread(peer)}; steps trained again {lost['peer']}")
    print(f"  peer recoveries' kinds: {[r['kind'] for r in results['peer']]}")
    ratio = statistics.median(peer) / statistics.median(restart)
    print(f"  ratio peer/restart (medians): {ratio:.3f}  (target <= 0.25)")
    emit("SIGKILL -> first step of the repaired group, peer / restart (medians)", ratio, target="<= 0.25",
         spread=f"peer {spread(peer)} s, restart {spread(restart)} s, {len(peer)} rounds")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spares", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1500, help="steps of each recovery job (more than 100)")
    parser.add_argument("--steady", type=int, default=0, help="steps of a fault-free run per mode (0: skip)")
    parser.add_argument(
        "--steady-rounds", type=int, default=None, help="fault-free rounds (default: --rounds)"
    )
    parser.add_argument(
        "--control", action="store_true", help="a second restart job in each steady round (A/A control)"
    )
    args = parser.parse_args()
    results: dict[str, list[dict[str, Any]]] = {"restart": [], "peer": []}
    arms = ("restart", "peer", "control") if args.control else ("restart", "peer")
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    paces: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as name, serving(Path(name) / "svc") as svc:
        for i in range(args.rounds):
            for mode in ("restart", "peer") if i % 2 == 0 else ("peer", "restart"):
                got = one_recovery(svc, mode, args.spares, args.steps)
                results[mode].append(got)
                print(f"  round {i + 1} {mode}: {got}", flush=True)
        for i in (
            range(args.steady_rounds if args.steady_rounds is not None else args.rounds)
            if args.steady
            else ()
        ):
            for arm in rotation(arms, i):
                mode = "restart" if arm == "control" else arm
                whole, pace = steady(svc, mode, args.spares, args.steady)
                rates[arm].append(whole)
                paces[arm].append(pace)
                print(f"  steady round {i + 1} {arm}: {whole:.0f} samples/s, median interval {pace:.0f}",
                      flush=True)  # fmt: skip
    if args.rounds:
        report_recoveries(results, args.spares)
    if args.steady:
        steady_ratio = statistics.median(rates["peer"]) / statistics.median(rates["restart"])
        print(f"  steady samples/s restart {[round(r) for r in rates['restart']]}")
        print(f"  steady samples/s peer    {[round(r) for r in rates['peer']]}")
        print(f"  ratio peer/restart (medians): {steady_ratio:.3f}  (target >= 0.98)")
        # each round's peer run against the restart run next to it (the rounds drift together)
        paired = [p / r for p, r in zip(rates["peer"], rates["restart"], strict=True)]
        shown = [round(x, 3) for x in paired]
        print(f"  per round, peer / the restart run beside it: {spread(paired, 3)} {shown}")
        # the same from each job's median 10-step interval (a noise burst moves few intervals)
        paired = [p / r for p, r in zip(paces["peer"], paces["restart"], strict=True)]
        shown = [round(x, 3) for x in paired]
        pace_ratio = statistics.median(paces["peer"]) / statistics.median(paces["restart"])
        print(f"  median 10-step interval samples/s restart {[round(r) for r in paces['restart']]}")
        print(f"  median 10-step interval samples/s peer    {[round(r) for r in paces['peer']]}")
        print(f"  ratio peer/restart of the median intervals (medians): {pace_ratio:.3f}  (target >= 0.98)")
        print(f"  per round, the same: {spread(paired, 3)} {shown}")
        if args.control:
            report_control(rates, paces)
    return 0


def report_control(rates: dict[str, list[float]], paces: dict[str, list[float]]) -> None:
    """Peer / restart against the A/A control, restart / restart, with their intervals."""
    for what, values in (("whole-run samples/s", rates), ("median 10-step interval", paces)):
        print(f"  {what}, geometric mean over {len(values['restart'])} rounds [95% bootstrap interval]:")
        for arm in ("peer", "control"):
            paired = [a / r for a, r in zip(values[arm], values["restart"], strict=True)]
            mean, lo, hi = interval = geomean_interval(paired)
            label = "peer / restart   " if arm == "peer" else "restart / restart"
            tail = verdict(interval, 0.98) if arm == "peer" else "the control: must hold 1"
            print(f"    {label} {mean:.3f} [{lo:.3f}, {hi:.3f}]  {tail}")


if __name__ == "__main__":
    sys.exit(main())
