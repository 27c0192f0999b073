"""Joining without stopping: a scale-up of a peer-mode job, measured.

A real ``elastrain serve`` runs the benchmark MLP in peer mode on 2 nodes x 1 process
(``nodes`` "2:3", a global batch of 384 that both world sizes divide); once it is past its
warm-up the job is scaled to 3 nodes over REST. The service starts the third node (a fresh
process: torchrun, ``import torch``, the model), which connects to the group's leader; the
survivors train on meanwhile, and at the next window boundary the leader re-forms the group with
the newcomer, a survivor sends it the state, and all three go on.

Every window's end time comes from the workers' sample trace (``ELASTRAIN_TRACE_SAMPLES``, its
``t``). For each survivor: its median step time at W=2 (the 200 windows before the join), the
longest step across the join (the longest of: its last W=2 window's end to its first W=3
window's end -- re-formation, transfer and one step --, and the two windows after it), and the
state transfer measured by the group (rank 0's ``peer_outcome`` phases, formed -> transferred).
Targets: longest <= 2 x median + transfer; the newcomer trains within 2 steps of joining (its
first window's step against the survivors' first W=3 step). On this 2-core machine a third
process makes every step slower (3 processes share 2 cores), so the ratio is printed against the
median step at W=2 and at W=3 (the 200 windows from the fifth after the join). Prints each round,
the medians with their spread, and the geometric mean of the rounds' ratios with its 95% bootstrap
interval (:mod:`benchmarks.stats`): the target is met when the whole interval is at most 1.

``--shape 1:2`` joins a second node to a one-node job instead (3 micro-steps a rank at both
sizes): every process has a core of its own here, but the step at W=1 has no all-reduce, so the
step after the join is longer by one (about 1.6x here). ``floor_ratio``: a join that costs
nothing of its own (the transfer, then one median step at the new size) against the same bound
-- the ratio's floor on this machine; what is above it is the join's own cost (re-formation, DDP
wrap and settle where it is not carried over, a first window slower than the median).
``noise_floor_ratio``: the same with one step at the new size as slow as the 90th percentile of
the ordinary ones -- how far this machine's noise in a single window reaches; a round above 1 and
below it missed by that noise, not by the join's own cost.

Where a first window's time goes: for the newcomer and the survivors, its first window at the new
size against its median one there -- the wall time, the training thread's CPU and its wait for a
core (the trace's ``wall_s``, ``cpu_s``, ``runq_s``); what is left of the wall time it waited on
the other member. And the survivors' second window there against the median one: what each
member's first step leaves to it (its run record, its etcd entry and the read of the others',
written and read on threads that share the interpreter with the training thread).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.record import emit
from benchmarks.service_job import events_of, serving
from benchmarks.service_job import spec as base_spec
from benchmarks.stats import geomean_interval, spread, verdict
from tests.integration.worker.test_service_e2e import Service, until

WARM = 200  # windows before the scale: the survivors' median step comes from these
AFTER = 3  # the longest step is the longest of the window across the join and the next two


SHAPES = {
    # 2 -> 3: a global batch of 384 that both world sizes divide (3 micro-steps a rank at W=2, 2 at W=3)
    "2:3": {"grad_accum_steps": None, "global_batch_size": 384},
    # 1 -> 2: every rank has a core of its own here; 3 micro-steps a rank at both sizes (the global
    # batch grows with the group, the worker core's batch/LR rule)
    "1:2": {"grad_accum_steps": 3},
}


def world_sizes(shape: str) -> tuple[int, int]:
    """The world sizes before and after the join, from ``"2:3"``."""
    low, high = shape.split(":")
    return int(low), int(high)


def spec(shape: str, max_steps: int) -> dict[str, Any]:
    return base_spec(
        nodes=shape, initial_nodes=world_sizes(shape)[0], nproc_per_node=1, recovery={"mode": "peer"},
        max_steps=max_steps, **SHAPES[shape],
    )  # fmt: skip


def traces(directory: Path, skip: set[Path]) -> dict[str, list[dict[str, Any]]]:
    """Each worker process's windows (a file per pid; ``skip``: earlier rounds'), in order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in set(directory.glob("rank-*.jsonl")) - skip:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        out[path.stem.split("-pid-")[1]] = sorted(rows, key=lambda r: r["t"])
    return out


def first_window(rows: list[dict[str, Any]], i: int, warm: int = WARM) -> dict[str, float]:
    """Window ``rows[i]`` (a process's first at the new size) against the median of its windows
    from the fifth after it: the excess of its ``wall_s``, ``cpu_s`` and ``runq_s`` (the training
    thread's, :mod:`worker.datapath.trace`), in ms; ``runq`` is absent where the trace could not read it."""
    later = rows[i + 5 : i + 5 + warm]
    out = {}
    for key in ("wall_s", "cpu_s", "runq_s"):
        if rows[i].get(key) is not None and all(r.get(key) is not None for r in later):
            median = statistics.median(r[key] for r in later)
            out[key.removesuffix("_s")] = round(1e3 * (rows[i][key] - median), 2)
    return out


def one_join(svc: Service, trace: Path, shape: str, max_steps: int, warm: int = WARM) -> dict[str, Any]:
    low, high = world_sizes(shape)
    earlier = set(trace.glob("rank-*.jsonl"))
    job_id = svc.submit(spec(shape, max_steps))
    until(lambda: (svc.job(job_id)["step"] or 0) >= warm + 50, "the job past its warm-up", 600)
    answer = svc.http.post(f"/v1/jobs/{job_id}/scale", json={"nodes": high})
    assert answer.status_code == 202, answer.text
    job = svc.finished(job_id, timeout=900)
    assert job["state"] == "SUCCEEDED", job["events"][-10:]
    by_pid = traces(trace, earlier)
    survivors = {p: rows for p, rows in by_pid.items() if {r["world_size"] for r in rows} == {low, high}}
    newcomers = {p: rows for p, rows in by_pid.items() if {r["world_size"] for r in rows} == {high}}
    sizes = {p: {r["world_size"] for r in rows} for p, rows in by_pid.items()}
    assert len(survivors) == low and len(newcomers) == high - low, sizes
    longest, medians, medians3, p90s, join_steps, last2, first3, second = [], [], [], [], [], [], [], []
    for rows in survivors.values():
        i = next(i for i, r in enumerate(rows) if r["world_size"] == high)  # the first window after
        ends = [r["t"] for r in rows[max(0, i - warm) : i]]
        medians.append(statistics.median(b - a for a, b in itertools.pairwise(ends)))
        after = [r["t"] for r in rows[i + 5 : i + 5 + warm]]
        steps_after = sorted(b - a for a, b in itertools.pairwise(after))
        medians3.append(statistics.median(steps_after))
        p90s.append(steps_after[int(0.9 * (len(steps_after) - 1))])
        last2.append(rows[i - 1]["t"])
        first3.append(rows[i]["t"])
        # the step across the join and the two after it (what the join leaves to the new group's
        # first steps -- the newcomer's first feed, rank 0's bookkeeping -- counts too)
        longest.append(max(rows[k]["t"] - rows[k - 1]["t"] for k in range(i, i + AFTER)))
        second.append(rows[i + 1]["t"] - rows[i]["t"] - medians3[-1])
        join_steps.append(rows[i]["step"])
    (arrived,) = newcomers.values()
    first = {"survivor": [], "newcomer": [first_window(arrived, 0, warm)]}
    for rows in survivors.values():
        i = next(i for i, r in enumerate(rows) if r["world_size"] == high)
        first["survivor"].append(first_window(rows, i, warm))
    events = events_of(Path(job["checkpoint_dir"]) / "events.jsonl")
    joined = [e for e in events if e["event"] == "peer_outcome" and e.get("world_size") == high]
    phases = joined[0]["phases"] if joined else {}
    transfer = (phases["transferred"] - phases["formed"]) if {"formed", "transferred"} <= set(phases) else 0.0
    moved = [e for e in events if e["event"] == "state_transferred" and e.get("receivers")]
    carried = [e for e in events if e["event"] == "state_transferred" and "ddp_carried_over" in e]
    median, median3 = max(medians), max(medians3)
    marks = [("window_end", max(last2))] + [
        (k, phases[k]) for k in ("detected", "formed", "transferred", "ready") if k in phases
    ]
    marks.append(("first_window_end", max(first3)))
    split = {f"{a}->{b}": round(tb - ta, 4) for (a, ta), (b, tb) in itertools.pairwise(marks)}
    return {
        "split_s": split,
        "median_step_s": round(median, 4),
        "median_step_after_s": round(median3, 4),
        "p90_step_after_s": round(max(p90s), 4),
        "longest_step_s": round(max(longest), 4),
        "transfer_s": round(transfer, 4),
        "transfer_mb": round(moved[-1]["bytes"] / 1e6, 2) if moved else 0.0,
        "ddp_carried_over": bool(carried and carried[-1]["ddp_carried_over"]),
        "bound_s": round(2 * median + transfer, 4),
        "ratio": round(max(longest) / (2 * median + transfer), 3),
        "ratio_after": round(max(longest) / (2 * median3 + transfer), 3),
        # a join that costs nothing of its own -- the transfer and one ordinary step at the new
        # size -- against the same bound: the floor of the ratio on this machine
        "floor_ratio": round((median3 + transfer) / (2 * median + transfer), 3),
        # the same with a first window as slow as one in ten ordinary windows at the new size: how
        # far this machine's noise in a single window reaches (a round above 1 and below this
        # missed by noise, not by what the join costs of its own)
        "noise_floor_ratio": round((max(p90s) + transfer) / (2 * median + transfer), 3),
        "newcomer_after_steps": arrived[0]["step"] - min(join_steps),
        # the window after the first at the new size (its first step's bookkeeping: each member's
        # run record, etcd entry) against the median one there, in ms; the most of the survivors'
        "second_window_excess_ms": round(1e3 * max(second), 2),
        # the first window at the new size against the process's median one there, in ms: its
        # wall time, the training thread's CPU and its wait for a core (the rest it waited on the
        # other member or a lock); the survivor's as the most of the survivors'
        "first_window_excess_ms": {
            who: {k: max(e[k] for e in excess) for k in excess[0]} for who, excess in first.items()
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3000, help="steps per job (a join takes ~10 s of them)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="2:3", help="nodes before:after the join")
    parser.add_argument("--warm", type=int, default=WARM, help="windows each median step is taken over")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as name:
        trace = Path(name) / "trace"
        trace.mkdir()
        with serving(Path(name) / "svc", {"ELASTRAIN_TRACE_SAMPLES": str(trace)}) as svc:
            for i in range(args.rounds):
                got = one_join(svc, trace, args.shape, args.steps, args.warm)
                results.append(got)
                print(f"  round {i + 1}: {got}", flush=True)
    by_key: dict[str, list[float]] = defaultdict(list)
    for r in results:
        for key, value in r.items():
            by_key[key].append(value)
    low, high = world_sizes(args.shape)
    print(f"scale-up {low} -> {high} of a peer-mode job ({low} node(s) x 1 process, the benchmark MLP)")
    print(f"  survivors' median step s {spread(by_key['median_step_s'], 3)} at W={low}, "
          f"{spread(by_key['median_step_after_s'], 3)} at W={high}")  # fmt: skip
    print(f"  longest step across the join s {spread(by_key['longest_step_s'], 3)}")
    print(f"  state transfer s {spread(by_key['transfer_s'], 3)} of MB {by_key['transfer_mb']}; "
          f"DDP carried over: {by_key['ddp_carried_over']}")  # fmt: skip
    print(f"  longest / (2 x median + transfer) {spread(by_key['ratio'], 3)}  (target <= 1)")
    print(f"  the same with the median step at W={high} {spread(by_key['ratio_after'], 3)}")
    print(f"  floor: (transfer + the median step at W={high}) / the same bound "
          f"{spread(by_key['floor_ratio'], 3)}")  # fmt: skip
    print(f"  noise floor: (transfer + the 90th percentile step at W={high}) / the same bound "
          f"{spread(by_key['noise_floor_ratio'], 3)}")  # fmt: skip
    interval = geomean_interval(by_key["ratio"])
    print(f"  geometric mean of the rounds' ratios {interval[0]:.3f}, 95% interval "
          f"[{interval[1]:.3f}, {interval[2]:.3f}]: {verdict(interval, 1.0, at_most=True)}")  # fmt: skip
    met = sum(r <= 1 for r in by_key["ratio"])
    within = sum(1 < r <= f for r, f in zip(by_key["ratio"], by_key["noise_floor_ratio"], strict=True))
    print(f"  rounds met: {met} of {len(results)}; missed within the noise floor: {within}")
    for who in ("survivor", "newcomer"):
        firsts = [r["first_window_excess_ms"][who] for r in results]
        parts = {k: [f[k] for f in firsts if k in f] for k in ("wall", "cpu", "runq")}
        print(f"  the {who}'s first window at W={high} over its median, ms: "
              + ", ".join(f"{k} {spread(v, 1)}" for k, v in parts.items() if v))  # fmt: skip
    print(f"  the survivors' second window at W={high} over its median, ms: "
          f"{spread(by_key['second_window_excess_ms'], 1)}")  # fmt: skip
    after = by_key["newcomer_after_steps"]
    print(f"  newcomer's first step after the join, in steps: {after}  (target <= 2)")
    emit(f"{low} -> {high}: the survivors' longest step across the join / (2 x median step + transfer)",
         interval[0], target="<= 1 (the whole interval); newcomer trains within 2 steps",
         spread=f"95% interval [{interval[1]:.3f}, {interval[2]:.3f}], {len(results)} rounds; "
         f"newcomer after {after} steps")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
