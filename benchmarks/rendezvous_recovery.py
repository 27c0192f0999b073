"""Re-rendezvous time after a failure: the etcd-v3 backend vs torchrun's c10d backend, side by side.

``python -m benchmarks.rendezvous_recovery [--rounds N]`` starts a real etcd and, per scenario,
two torchrun agents (``--nnodes 1:3``: a job running below its maximum, where the last-call
timeout applies) running a tiny gloo all-reduce loop; it SIGKILLs one worker and measures the
time from the kill to the first step of the re-formed world of 2. Also: node loss (an agent and
its workers killed) with etcd-v3, and the latency of one rendezvous state read and write.
Prints seconds and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.record import emit
from benchmarks.stats import spread
from scripts.demo import parent_pid
from service.etcd.server import EtcdServer
from service.ports import free_port

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "integration" / "rendezvous" / "rdzv_worker.py"


class Run:
    def __init__(self, workdir: Path, *, backend: str, endpoint: str, conf: str) -> None:
        self.workdir, self.backend, self.endpoint, self.conf = workdir, backend, endpoint, conf
        self.events = workdir / "events.jsonl"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "RDZV_TEST_OUT": str(self.events),
            "RDZV_TEST_STOP": str(workdir / "STOP"),
        }
        self.run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.agents: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1:3", "--nproc-per-node=1",
            f"--rdzv-backend={self.backend}", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
            "--max-restarts=3", "--monitor-interval=0.1",
        ] + ([f"--rdzv-conf={self.conf}"] if self.conf else []) + [str(WORKER)]  # fmt: skip
        log = open(self.workdir / f"agent-{len(self.agents)}.log", "wb")  # noqa: SIM115
        self.agents.append(
            subprocess.Popen(
                cmd, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        log.close()

    def steps(self) -> list[dict[str, Any]]:
        if not self.events.exists():
            return []
        rows = [json.loads(x) for x in self.events.read_text().splitlines() if x.strip()]
        return [r for r in rows if r["event"] == "step"]

    def wait(self, predicate: Any, timeout: float = 180.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.steps()
            if predicate(rows):
                return rows
            time.sleep(0.05)
        raise RuntimeError(f"timed out; see logs in {self.workdir}")

    def finish(self) -> None:
        (self.workdir / "STOP").touch()
        for agent in self.agents:
            try:
                agent.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)


def worker_kill(workdir: Path, *, backend: str, endpoint: str, conf: str) -> float:
    run = Run(workdir, backend=backend, endpoint=endpoint, conf=conf)
    run.start()
    run.start()
    try:
        rows = run.wait(lambda r: {e["rank"] for e in r if e["world"] == 2} == {0, 1})
        old = {e["pid"] for e in rows}
        victim = next(e for e in reversed(rows) if e["rank"] == 1)
        killed = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        # A new attempt shows as new worker pids (restart counts differ between agents).
        rows = run.wait(lambda r: {e["rank"] for e in r if e["world"] == 2 and e["pid"] not in old} == {0, 1})
        new = [e for e in rows if e["world"] == 2 and e["pid"] not in old]
        return max(min(e["time"] for e in new if e["rank"] == k) for k in (0, 1)) - killed
    finally:
        run.finish()


def node_loss(workdir: Path, *, endpoint: str) -> float:
    run = Run(workdir, backend="etcd-v3", endpoint=endpoint, conf="")
    run.start()
    run.start()
    try:
        rows = run.wait(lambda r: {e["rank"] for e in r if e["world"] == 2} == {0, 1})
        doomed = run.agents[1]
        workers = [e["pid"] for e in rows if parent_pid(e["pid"]) == doomed.pid]
        lost = time.time()
        os.killpg(doomed.pid, signal.SIGKILL)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        rows = run.wait(lambda r: any(e["world"] == 1 for e in r))
        return min(e["time"] for e in rows if e["world"] == 1) - lost
    finally:
        run.agents = [a for a in run.agents if a.poll() is None]
        run.finish()


def state_latency(endpoint: str, n: int = 200) -> tuple[float, float]:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from service.rendezvous.handler import create_backend

    backend, _, _ = create_backend(
        RendezvousParameters("etcd-v3", endpoint, f"lat-{uuid.uuid4().hex[:6]}", 1, 1)
    )
    _, token, _ = backend.set_state(b"x" * 2048, None) or (b"", None, False)
    t0 = time.perf_counter()
    for _ in range(n):
        backend.get_state()
    t1 = time.perf_counter()
    for _ in range(n):
        _, token, _ = backend.set_state(b"y" * 2048, token) or (b"", token, False)
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e3, (t2 - t1) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--skip-default", action="store_true", help="skip c10d with torch's defaults (~40 s)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    results: dict[str, list[float]] = {
        "etcd-v3": [],
        "c10d default": [],
        "c10d tuned": [],
        "etcd-v3 node loss": [],
    }
    with EtcdServer(root / "etcd") as etcd:
        get_ms, set_ms = state_latency(etcd.endpoint)
        for i in range(args.rounds):
            for name, backend, conf in [
                ("etcd-v3", "etcd-v3", ""),
                ("c10d default", "c10d", ""),
                ("c10d tuned", "c10d", "last_call_timeout=3,keep_alive_interval=2"),
            ]:
                if args.skip_default and name == "c10d default":
                    continue
                endpoint = etcd.endpoint if backend == "etcd-v3" else f"127.0.0.1:{free_port()}"
                workdir = root / f"{name.replace(' ', '-')}-{i}"
                workdir.mkdir()
                results[name].append(worker_kill(workdir, backend=backend, endpoint=endpoint, conf=conf))
            workdir = root / f"node-loss-{i}"
            workdir.mkdir()
            results["etcd-v3 node loss"].append(node_loss(workdir, endpoint=etcd.endpoint))
    base = statistics.median(results["c10d default"] or results["c10d tuned"])
    base_name = "c10d default" if results["c10d default"] else "c10d tuned"
    print(f"rendezvous state (2 KiB) through etcd-v3: get {get_ms:.2f} ms, compare-and-set {set_ms:.2f} ms")
    print("worker SIGKILL -> first step of the re-formed world (2 of --nnodes 1:3):")
    for name, values in results.items():
        if values:
            median = statistics.median(values)
            runs = ", ".join(f"{v:.2f}" for v in values)
            print(f"  {name:18s} {median:6.2f} s   ({median / base:.2f}x {base_name})   runs: {runs}")
    print(f"logs: {root}")
    ours = results["etcd-v3"]
    emit(f"worker SIGKILL -> first step of the re-formed world, etcd-v3 / {base_name}",
         statistics.median(ours) / base, spread=f"etcd-v3 {spread(ours)} s")  # fmt: skip


if __name__ == "__main__":
    main()
