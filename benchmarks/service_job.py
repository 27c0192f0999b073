"""A job under the service against bare ``torchrun -m worker``, side by side in one run.

1. Throughput: the same spec (1 node x 2 processes) bare and under ``elastrain serve`` (agents,
   heartbeats, etcd, progress callbacks); samples/s from the workers' own progress events.
   Target: service / bare >= 0.98 (with ``--nodes 2``, the service's 2 one-process node apps
   against bare 1 x 2, nothing in the job's env: >= 0.95, the threads the service sets). Under
   the service the job runs in its default recovery mode
   (``auto``: peer for DDP) and, in the same rounds, in ``restart`` mode, the mode bare torchrun
   runs: restart / bare is what the service itself costs, peer / restart what peer mode costs in
   steady state (target >= 0.98). Each side also reports its workers' main-thread CPU
   per step (``/proc``, steps 100 to the end less 100): a side that computes more per step shows
   there, one that waits more does not.
2. Recovery: under the service, SIGKILL one worker after a checkpoint; the service measures
   failure -> first step after resume. The floor, measured in the same run: a fresh torchrun of
   the same spec resuming from that checkpoint, launch -> first step (respawn, import torch,
   process group, load, one step). Target: recovery / floor <= 1.3.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from benchmarks.peer_probe import stat_ticks
from benchmarks.record import emit, spread_of
from scripts.demo import worker_pids
from service.launch.threads import host_cores
from tests.integration.launch import REPO, worker_env
from tests.integration.worker.test_service_e2e import Service, until
from worker.metrics import DEFAULT_TARGETS_DIR


def spec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "bench",
        "model": {"name": "mlp", "kwargs": {"hidden": 512, "depth": 4}},
        "data": {"name": "synthetic", "samples": 65536, "kwargs": {"input_dim": 128}},
        "micro_batch_size": 64,
        "grad_accum_steps": 2,
        "max_steps": 300,
        "log_every_steps": 10,
        "nodes": "1",
        "nproc_per_node": 2,
        "max_restarts": 3,
    }
    return base | over


@contextlib.contextmanager
def serving(data_dir: Path, env: dict[str, str] | None = None) -> Iterator[Service]:
    """A real ``elastrain serve`` on a new data directory, stopped at the end."""
    svc = Service(data_dir, env or {})
    svc.data_dir.mkdir()
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def rate(events: list[dict[str, Any]]) -> float:
    progress = [e for e in events if e["event"] == "progress"]
    first, last = progress[0], progress[-1]
    return float((last["samples_seen"] - first["samples_seen"]) / (last["time"] - first["time"]))


def interval_rate(events: list[dict[str, Any]]) -> float:
    """The median of the samples/s between consecutive progress events (every
    ``log_every_steps``): the steady pace, which a burst of this machine's noise in a minority of
    the intervals does not move (:func:`rate` spreads such a burst over the whole run)."""
    progress = [e for e in events if e["event"] == "progress"]
    return float(
        statistics.median(
            (b["samples_seen"] - a["samples_seen"]) / (b["time"] - a["time"])
            for a, b in itertools.pairwise(progress)
            if b["time"] > a["time"]
        )
    )


def events_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


def bare(tmp: Path, body: dict[str, Any]) -> list[dict[str, Any]]:
    return bare_cpu(tmp, body)[0]


class CpuMarks:
    """The workers' main-thread CPU at two steps of a run: the first sight of step 100 and of
    ``max_steps - 100``; :meth:`per_step` is the CPU ms per step and process between them (None
    for a run too short, or one not seen at both)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.last, self.nproc = body["max_steps"] - 100, body["nproc_per_node"]
        self.marks: list[tuple[int, float]] = []  # (step, main-thread CPU s per process)

    def wants(self, step: int) -> bool:
        return len(self.marks) < 2 and self.last > 100 and step >= (100 if not self.marks else self.last)

    def add(self, step: int, pids: list[int]) -> None:
        if len(pids) == self.nproc:  # every worker seen, none exiting yet
            self.marks.append((step, main_thread_cpu(pids) / len(pids)))

    def per_step(self) -> float | None:
        if len(self.marks) < 2 or self.marks[1][0] <= self.marks[0][0]:
            return None
        (a, cpu_a), (b, cpu_b) = self.marks
        return 1e3 * (cpu_b - cpu_a) / (b - a)


def bare_cpu(tmp: Path, body: dict[str, Any]) -> tuple[list[dict[str, Any]], float | None]:
    """A bare ``torchrun -m worker`` of ``body``: its events, and its workers' main-thread CPU ms
    per step and process (:class:`CpuMarks`, read at the progress events the workers print as
    they go, as :func:`under_service` reads it at the job's reported step)."""
    path = tmp / f"bare-{time.time_ns()}.json"
    path.write_text(json.dumps(body))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "worker", "--config", str(path)]  # fmt: skip
    events: list[dict[str, Any]] = []
    marks = CpuMarks(body)
    log = tmp / f"{path.stem}.stderr"
    with (
        log.open("w") as err,
        subprocess.Popen(
            cmd, env=worker_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            event = json.loads(line)
            events.append(event)
            step = event.get("step", 0) if event["event"] == "progress" else 0
            if marks.wants(step):
                marks.add(step, children(proc.pid))
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=log.read_text()[-4000:])
    return events, marks.per_step()


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (torchrun's workers)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def scrape(svc: Service, job_id: str) -> int:
    """What a Prometheus on this machine scrapes: the service and the job's worker exporters
    (their file_sd target files, see worker.metrics). Returns how many worker endpoints."""
    svc.http.get("/metrics").raise_for_status()
    scraped = 0
    for target_file in Path(DEFAULT_TARGETS_DIR).glob(f"{job_id}-*.json"):
        try:
            groups = json.loads(target_file.read_text())
        except (OSError, ValueError):
            continue  # the exporter is replacing it
        for address in (a for g in groups for a in g["targets"]):
            try:
                httpx.get(f"http://{address}/metrics", timeout=5).raise_for_status()
            except httpx.HTTPError:
                continue  # a worker exiting (Prometheus counts a failed scrape and goes on)
            scraped += 1
    return scraped


def main_thread_cpu(pids: list[int]) -> float:
    """The CPU seconds the main threads of ``pids`` have used (utime + stime, ``/proc``); a
    process already gone counts 0."""
    got = (stat_ticks(f"/proc/{pid}/task/{pid}/stat") for pid in pids)
    return sum(g[2] for g in got if g is not None) / os.sysconf("SC_CLK_TCK")


def under_service(svc: Service, body: dict[str, Any]) -> dict[str, Any]:
    """Run a job under the service, watched as a user would: ``GET /v1/jobs/{id}`` once a second
    (``elastrain status --watch``'s default) and the service's and workers' ``/metrics`` every
    15 s (Prometheus' default scrape interval). The test helper's 0.3 s poll would add its own
    load to one side only. ``cpu_ms_per_step``: the workers' main threads, per process, between
    the first sight of step 100 and of ``max_steps - 100`` (None for a job too short)."""
    job_id = svc.submit(body)
    deadline = time.monotonic() + 900
    next_scrape, endpoints = time.monotonic() + 5, 0
    marks = CpuMarks(body)
    while time.monotonic() < deadline:
        job = svc.job(job_id)
        step = job.get("step") or 0
        if marks.wants(step):
            marks.add(step, worker_pids(job_id))
        if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            assert job["state"] == "SUCCEEDED", job
            return job | {"worker_endpoints_scraped": endpoints, "cpu_ms_per_step": marks.per_step()}
        if time.monotonic() >= next_scrape:
            endpoints = max(endpoints, scrape(svc, job_id))
            next_scrape += 15
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} did not finish in 900 s")


def recovery(svc: Service, tmp: Path, *, steps: int = 400) -> tuple[float, float]:
    body = spec(max_steps=steps, checkpoint={"interval_steps": 50, "retention": {"keep_latest": 50}})
    job_id = svc.submit(body)
    until(lambda: (svc.job(job_id)["last_published_step"] or 0) >= 100, "a checkpoint", 600)
    victim = until(lambda: worker_pids(job_id), "a worker", 60)[-1]
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    job = svc.finished(job_id, timeout=900)
    # The workers' own events: the first step after the kill ends the recovery. (The service
    # sees an in-place torchrun restart only when the new group reports, so its clock starts late.)
    events = events_of(Path(job["checkpoint_dir"]) / "events.jsonl")
    first_after = next(e for e in events if e["event"] == "first_step" and e["time"] > killed)
    measured = first_after["time"] - killed
    resumed = next(e["step"] for e in events if e["event"] == "resumed" and e["time"] > killed)
    # The floor: resume the same checkpoint in a fresh torchrun and time launch -> first step.
    copy = tmp / "floor"
    shutil.copytree(Path(job["checkpoint_dir"]) / f"step-{resumed:08d}", copy / f"step-{resumed:08d}")
    (copy / "latest").write_text(f"step-{resumed:08d}\n")
    started = time.time()
    floor_events = bare(tmp, spec(max_steps=resumed + 1, checkpoint={"dir": str(copy)}))
    first = next(e for e in floor_events if e["event"] == "first_step")
    return measured, first["time"] - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds of: bare, service, restart mode")
    parser.add_argument("--steps", type=int, default=1000, help="steps per throughput run (~20 s)")
    parser.add_argument(
        "--nodes", type=int, default=1, choices=(1, 2),
        help="2: the service runs 2 nodes x 1 process (a one-process torchrun per node app, where "
        "torchrun sets no thread count) against bare torchrun's 1 x 2",
    )  # fmt: skip
    parser.add_argument("--no-recovery", action="store_true", help="throughput only")
    parser.add_argument(
        "--quick", action="store_true",
        help="make test's check that it runs: 1 round of 100 steps, no warm-up, a 200-step recovery job",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 1, 100
    shape = {"nodes": str(args.nodes), "nproc_per_node": 2 // args.nodes}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        rates: dict[str, list[float]] = {"bare": [], "service": [], "restart": []}
        cpus: dict[str, list[float]] = {"bare": [], "service": [], "restart": []}
        # The service's default slot count on this host (its cores; nothing in any job's env).
        with serving(tmp / "svc", {"ELASTRAIN_LOCAL_SLOTS": str(host_cores())}) as svc:
            if not args.quick:  # warm-up of both paths (page cache, first TorchX launch)
                bare(tmp, spec(max_steps=20))
                under_service(svc, spec(max_steps=20))
            sides = ["bare", "service", "restart"]
            for i in range(args.rounds):  # interleaved, rotating, so drift on a shared machine hits all
                for side in sides[i % 3 :] + sides[: i % 3]:
                    if side == "bare":
                        events, cpu = bare_cpu(tmp, spec(max_steps=args.steps))
                    else:
                        mode = {"service": "auto", "restart": "restart"}[side]
                        job = under_service(svc, spec(max_steps=args.steps, recovery={"mode": mode}, **shape))
                        events = events_of(Path(job["checkpoint_dir"]) / "events.jsonl")
                        cpu = job["cpu_ms_per_step"]
                    rates[side].append(rate(events))
                    if cpu is not None:
                        cpus[side].append(cpu)
                r = {side: v[-1] for side, v in rates.items()}
                print(f"  round {i + 1}: samples/s bare {r['bare']:,.0f}, service {r['service']:,.0f} "
                      f"(restart mode {r['restart']:,.0f}): service/bare {r['service'] / r['bare']:.3f}, "
                      f"restart mode/bare {r['restart'] / r['bare']:.3f}, peer/restart "
                      f"{r['service'] / r['restart']:.3f} (worker endpoints scraped: "
                      f"{job['worker_endpoints_scraped']})", flush=True)  # fmt: skip
            steps = 200 if args.quick else 400
            measured, floor = (0.0, 0.0) if args.no_recovery else recovery(svc, tmp, steps=steps)

    def ratio(a: str, b: str) -> str:
        pairs = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
        return f"{statistics.median(pairs):.3f} (rounds {min(pairs):.3f}-{max(pairs):.3f})"

    print(f"job under the service ({args.nodes} x {2 // args.nodes}) vs bare torchrun (1 x 2), W=2, "
          "same spec, nothing in env")  # fmt: skip
    print(f"  ratio service/bare, median of {args.rounds} interleaved rounds: "
          f"{ratio('service', 'bare')}  (target >= {0.95 if args.nodes == 2 else 0.98})")  # fmt: skip
    print(f"  the service in restart mode / bare (what the service itself costs): {ratio('restart', 'bare')}")
    print(f"  peer / restart mode under the service (steady state, target >= 0.98): "
          f"{ratio('service', 'restart')}")  # fmt: skip
    for side, label in (("bare", "bare"), ("service", "service (peer)"), ("restart", "service (restart)")):
        if cpus[side]:
            print(
                f"  {label}: workers' main-thread CPU per step and process, median "
                f"{statistics.median(cpus[side]):.1f} ms ({min(cpus[side]):.1f}-{max(cpus[side]):.1f})"
            )
    if args.no_recovery:
        return 0
    print(f"  recovery (SIGKILL -> first step) {measured:.2f} s")
    print(f"  floor (fresh torchrun resuming that checkpoint -> first step) {floor:.2f} s")
    print(f"  ratio recovery/floor: {measured / floor:.2f}  (target <= 1.3)")
    pairs = [x / y for x, y in zip(rates["service"], rates["bare"], strict=True)]
    emit("service / bare samples/s, median of the rounds' ratios", statistics.median(pairs), target=">= 0.98",
         spread=f"{spread_of(pairs)}; recovery / floor {measured / floor:.2f} (target <= 1.3)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
