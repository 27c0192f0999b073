"""A SIGTERM's cost: time from the signal to the processes' exit against the grace period, and
the steps lost, under a bare torchrun and under the service, side by side in one run.

Bare: ``torchrun --standalone --nproc-per-node 2 -m worker`` on a 2-process job; at step
``--at`` the agent gets a SIGTERM. Exit time: signal -> torchrun's exit. Steps lost: the step
the workers stopped at less the newest published checkpoint (what the same command resumes
from). Under the service: the same job (1 node x 2 processes, restart mode) under ``elastrain
serve`` with its local scheduler; the SIGTERM goes to the node's first process (the node
wrapper, as a kubelet's would). Exit time: signal -> the wrapper's recorded end; steps lost: the
service's incident (``steps_lost``), once the relaunched node trained again, and the restarts it
used. Targets (issue text): exit within ``preemption.grace_s`` (25 s), 0 steps lost, 0 restarts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import record
from tests.integration.launch import REPO, torchrun_cmd, worker_env, write_spec
from tests.integration.worker.test_service_e2e import Service, until
from worker.jobspec.preemption import DEFAULT_GRACE_S


def spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "preempt-bench",
        "model": {"name": "mlp", "kwargs": {"hidden": 512, "depth": 4}},
        "data": {"name": "synthetic", "samples": 65536, "kwargs": {"input_dim": 128}},
        "micro_batch_size": 64,
        "grad_accum_steps": 2,
        "max_steps": 3000,
        "log_every_steps": 10,
        "nodes": "1",
        "nproc_per_node": 2,
        "max_restarts": 3,
        "recovery": {"mode": "restart"},
    }
    return base | over


def bare_round(tmp: Path, at: int) -> dict[str, Any]:
    ck = tmp / "ck"
    path = write_spec(tmp, spec(checkpoint={"dir": str(ck), "interval_steps": 1000}))
    proc = subprocess.Popen(
        torchrun_cmd(2, path), env=worker_env(), cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    events: list[dict[str, Any]] = []
    reached = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                events.append(json.loads(line))
                if events[-1]["event"] == "progress" and events[-1]["step"] >= at:
                    reached.set()

    threading.Thread(target=read, daemon=True).start()
    if not reached.wait(600):
        proc.kill()
        raise SystemExit(f"bare: step {at} never came")
    signalled = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=600)
    exit_s = time.monotonic() - signalled
    time.sleep(0.2)
    stopped = next(e["step"] for e in events if e["event"] == "preempted")
    newest = max(int(p.parent.name.removeprefix("step-")) for p in ck.glob("step-*/manifest.json"))
    return {"exit_s": exit_s, "steps_lost": stopped - newest, "restarts": 0, "exit_code": proc.returncode}


def service_round(svc: Service, at: int) -> dict[str, Any]:
    job_id = svc.submit(spec(checkpoint={"interval_steps": 1000}))
    until(lambda: (svc.job(job_id)["step"] or 0) >= at, f"step {at}", 600)
    (node,) = [p for p in (svc.data_dir / "nodes" / job_id).glob("*/node.json")]
    pid = int(json.loads(node.read_text())["pid"])
    signalled = time.time()
    os.kill(pid, signal.SIGTERM)
    ended = until(lambda: _ended(node.parent), "the node's exit", 120)
    job = until(
        lambda: (j := svc.job(job_id))["recoveries"] and j["recoveries"][-1]["steps_lost"] is not None and j,
        "the relaunched node's first step",
        600,
    )
    svc.http.delete(f"/v1/jobs/{job_id}")
    recovery = job["recoveries"][-1]
    return {
        "exit_s": ended["ended_at"] - signalled, "steps_lost": recovery["steps_lost"],
        "restarts": job["restarts"], "exit_code": ended["exit_code"], "kind": recovery["kind"],
    }  # fmt: skip


def _ended(node_dir: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        data: dict[str, Any] = json.loads((node_dir / "exit.json").read_text())
        return data
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.preemption", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--at", type=int, default=200, help="the step at which the SIGTERM comes")
    args = parser.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {"bare torchrun": [], "under the service": []}
    with tempfile.TemporaryDirectory(prefix="elastrain-preempt-") as tmp:
        svc = Service(Path(tmp) / "svc", {"PYTHONPATH": str(REPO)})  # the tree this script is in
        svc.data_dir.mkdir()
        svc.start()
        try:
            for n in range(args.rounds):  # interleaved: both sides see the same machine
                round_dir = Path(tmp) / f"bare-{n}"
                round_dir.mkdir()
                rows["bare torchrun"].append(bare_round(round_dir, args.at))
                rows["under the service"].append(service_round(svc, args.at))
        finally:
            svc.stop()
    print(f"SIGTERM at step {args.at}, grace period {DEFAULT_GRACE_S:g} s, {args.rounds} round(s)")
    print(f"{'':20} {'exit s (median)':>16} {'max':>7} {'/ grace':>8} {'steps lost':>11} {'restarts':>9}")
    for side, found in rows.items():
        times = [r["exit_s"] for r in found]
        lost = max(r["steps_lost"] for r in found)
        used = max(r["restarts"] for r in found)
        print(
            f"{side:20} {statistics.median(times):16.2f} {max(times):7.2f} "
            f"{max(times) / DEFAULT_GRACE_S:8.3f} {lost:11d} {used:9d}"
        )
        print(f"{'':20} rounds: {json.dumps(found)}")
    met = all(
        r["exit_s"] < DEFAULT_GRACE_S and r["steps_lost"] == 0 and r["restarts"] == 0
        for found in rows.values()
        for r in found
    )
    print(f"target (exit within the grace period, 0 steps lost, 0 restarts): {'met' if met else 'NOT met'}")
    every = [r for found in rows.values() for r in found]
    lost = max(r["steps_lost"] for r in every)
    record.emit(
        "SIGTERM to exit / grace period, the slowest round (bare torchrun and under the service)",
        max(r["exit_s"] for r in every) / DEFAULT_GRACE_S,
        target="< 1, 0 steps lost",
        spread=f"{len(every)} rounds; steps lost at most {lost}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
