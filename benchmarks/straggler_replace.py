"""A straggler replaced by a warm spare: the job's throughput before the slowdown, while one
member is slowed, and in the two straggler windows after the spare joined.

Under a real ``elastrain serve`` (its local scheduler; the service and its nodes run this tree's
code), the benchmark job of ``benchmarks/service_job.py`` in peer mode on 2 one-process nodes with
1 warm spare and ``stragglers.action: replace`` (``--window`` steps a window, the other straggler
settings at their defaults). From step ``3 x window`` the worker of the member in slot 1 is
stopped and continued in the duty cycle of ``tests/faults/test_stragglers.py`` until the group
replaces it. The pace is the median samples/s between rank 0's ``progress`` events (every 5
steps): before = from step ``window`` to the slowdown's start; slowed = from then to the
straggler's leave (the recovery's ``failed_at``); then each window of steps after the repaired
group's first step. The record is the second window's pace over the pace before (target >= 0.9:
the pace is back by the end of two windows). The windows after the join also carry the start
of the new spare the local scheduler launches in the node's place (importing torch and building
the trainer on the same cores, until it stands by: printed), which a spare on its own machine
would not.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.record import emit
from benchmarks.service_job import events_of, serving
from benchmarks.service_job import spec as base_spec
from scripts.demo import worker_pids
from tests.faults.test_straggler_replace import duty_cycle
from tests.integration.launch import REPO
from tests.integration.worker.test_service_e2e import until


def pace(progress: Sequence[dict[str, Any]], *, start: float, end: float) -> float | None:
    """The median samples/s between consecutive ``progress`` events from ``start`` to ``end`` (a
    burst of this machine's noise in a minority of the intervals does not move it; None: no
    interval there). Pure."""
    inside = [e for e in progress if start <= e["time"] <= end]
    rates = [
        (b["samples_seen"] - a["samples_seen"]) / (b["time"] - a["time"])
        for a, b in itertools.pairwise(inside)
        if b["time"] > a["time"]
    ]
    return float(statistics.median(rates)) if rates else None


def phases(
    progress: Sequence[dict[str, Any]], *, window: int, slowed_at: float, left_at: float, joined_at: float
) -> tuple[float | None, float | None, list[float | None]]:
    """The pace before the slowdown (from step ``window``), while slowed, and in each window of
    ``window`` steps after the repaired group's first step. Pure."""
    warm = next((e["time"] for e in progress if e["step"] >= window), slowed_at)
    joined = [e for e in progress if e["time"] >= joined_at]
    bounds = [e["time"] for e in joined if (e["step"] - joined[0]["step"]) % window == 0] if joined else []
    after = [pace(progress, start=a, end=b) for a, b in itertools.pairwise(bounds)]
    return pace(progress, start=warm, end=slowed_at), pace(progress, start=slowed_at, end=left_at), after


def job(window: int) -> dict[str, Any]:
    return base_spec(
        nodes="2", nproc_per_node=1, spares=1, recovery={"mode": "peer"}, max_steps=12 * window,
        log_every_steps=5, stragglers={"window_steps": window, "action": "replace"},
    )  # fmt: skip


def member(job: dict[str, Any], slot: int) -> str | None:
    """The launch id of the running member in ``slot`` (a spare may have taken it), or None. Pure."""
    return next(
        (n["launch_id"] for n in job["nodes"]
         if n["role"] == "member" and n["index"] == slot and n["phase"] == "running"),
        None,
    )  # fmt: skip


def slot_workers(job: dict[str, Any], slot: int) -> list[int]:
    """The worker processes of the running member in ``slot``."""
    launch_id = member(job, slot)
    return worker_pids(launch_id=launch_id) if launch_id else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--window", type=int, default=50, help="stragglers.window_steps")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp, serving(Path(tmp) / "svc", {"PYTHONPATH": str(REPO)}) as svc:
        job_id = svc.submit(job(args.window))
        until(lambda: (svc.job(job_id)["step"] or 0) >= 3 * args.window, "the job before the slowdown", 900)
        (pid,) = until(lambda: slot_workers(svc.job(job_id), 1), "slot 1's worker", 120)
        slowed_at = time.time()
        cycled = duty_cycle(svc, job_id, pid)
        final = svc.finished(job_id, timeout=1800)
        events = events_of(Path(final["checkpoint_dir"]) / "events.jsonl")
        standby = sorted(
            json.loads(line)["time"]
            for launch in svc.launches(job_id)
            for line in svc.node_output(job_id, launch).splitlines()
            if '"spare_standby"' in line
        )
    assert final["state"] == "SUCCEEDED", final["events"][-12:]
    replaced = [e["message"] for e in final["events"] if e["kind"] == "straggler_replaced"]
    # A rank the machine's load slowed before ours may have been replaced already: the recovery
    # measured is the one that followed the slowdown
    recovery = next((r for r in final["recoveries"] if r["failed_at"] >= slowed_at), None)
    assert replaced and recovery, ("not replaced", final["events"][-12:])
    progress = [e for e in events if e["event"] == "progress"]
    left_at, joined_at = recovery["failed_at"], recovery["first_step_at"]
    before, during, after = phases(
        progress, window=args.window, slowed_at=slowed_at, left_at=left_at, joined_at=joined_at
    )
    assert before and len(after) >= 2 and after[1], (before, after)
    ratios = ", ".join("n/a" if r is None else f"{r / before:.2f}" for r in after)
    print(f"straggler replaced: {replaced[0]}")
    print(f"  duty cycle on node 1's worker: {cycled}; recovery {recovery['seconds']:.2f} s, "
          f"{recovery['bytes_from_storage'] or 0} bytes from storage")  # fmt: skip
    print(f"  samples/s before the slowdown {before:.1f}, slowed {(during or 0) / before:.2f}x; each window "
          f"after the spare joined: {ratios} x before")  # fmt: skip
    late = [t - joined_at for t in standby if t > joined_at]  # the spare launched in the node's place
    if late:
        print(f"  the new spare stood by {late[0]:.1f} s after the repaired group's first step (its "
              f"start-up shares these cores with the training until then)")  # fmt: skip
    print(f"  load average (1 min) before {load:.2f}, after {os.getloadavg()[0]:.2f}")
    emit(
        "samples/s in the second straggler window after the spare joined / before the slowdown",
        after[1] / before,
        target=">= 0.9",
        spread=f"window {args.window} steps; windows after the join {ratios}; slowed "
        f"{(during or 0) / before:.2f}x; recovery {recovery['seconds']:.2f} s, 0 restarts; "
        f"load {load:.1f}-{os.getloadavg()[0]:.1f}"
        + (f"; the new spare stood by {late[0]:.1f} s after the join" if late else ""),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
