"""A job under the service against bare ``torchrun -m worker``, side by side in one run.

1. Throughput: the same spec (1 node x 2 processes) bare and under ``elastrain serve`` (agents,
   heartbeats, etcd, progress callbacks); samples/s from the workers' own progress events.
   Target: service / bare >= 0.98.
2. Recovery: under the service, SIGKILL one worker after a checkpoint; the service measures
   failure -> first step after resume. The floor, measured in the same run: a fresh torchrun of
   the same spec resuming from that checkpoint, launch -> first step (respawn, import torch,
   process group, load, one step). Target: recovery / floor <= 1.3.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path
from typing import Any

import httpx

from scripts.demo import worker_pids
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
    path = tmp / f"bare-{time.time_ns()}.json"
    path.write_text(json.dumps(body))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "worker", "--config", str(path)]  # fmt: skip
    out = subprocess.run(cmd, env=worker_env(), cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


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


def under_service(svc: Service, body: dict[str, Any]) -> dict[str, Any]:
    """Run a job under the service, watched as a user would: ``GET /v1/jobs/{id}`` once a second
    (``elastrain status --watch``'s default) and the service's and workers' ``/metrics`` every
    15 s (Prometheus' default scrape interval). The test helper's 0.3 s poll would add its own
    load to one side only."""
    job_id = svc.submit(body)
    deadline = time.monotonic() + 900
    next_scrape, endpoints = time.monotonic() + 5, 0
    while time.monotonic() < deadline:
        job = svc.job(job_id)
        if job["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            assert job["state"] == "SUCCEEDED", job
            return job | {"worker_endpoints_scraped": endpoints}
        if time.monotonic() >= next_scrape:
            endpoints = max(endpoints, scrape(svc, job_id))
            next_scrape += 15
        time.sleep(1.0)
    raise AssertionError(f"job {job_id} did not finish in 900 s")


def recovery(svc: Service, tmp: Path) -> tuple[float, float]:
    body = spec(max_steps=400, checkpoint={"interval_steps": 50, "retention": {"keep_latest": 50}})
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
    parser.add_argument("--rounds", type=int, default=6, help="interleaved bare/service pairs")
    parser.add_argument("--steps", type=int, default=1000, help="steps per throughput run (~20 s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        svc = Service(tmp / "svc", {})
        svc.data_dir.mkdir()
        svc.start()
        ratios = []
        try:
            bare(tmp, spec(max_steps=20))  # warm-up of both paths (page cache, first TorchX launch)
            under_service(svc, spec(max_steps=20))
            for i in range(args.rounds):  # interleaved, ABBA, so drift on a shared machine hits both
                order = ("bare", "service") if i % 2 == 0 else ("service", "bare")
                for side in order:
                    if side == "bare":
                        bare_rate = rate(bare(tmp, spec(max_steps=args.steps)))
                    else:
                        job = under_service(svc, spec(max_steps=args.steps))
                        svc_rate = rate(events_of(Path(job["checkpoint_dir"]) / "events.jsonl"))
                ratios.append(svc_rate / bare_rate)
                print(f"  round {i + 1}: bare {bare_rate:,.0f} samples/s, service {svc_rate:,.0f}: "
                      f"{ratios[-1]:.3f} (worker endpoints scraped: {job['worker_endpoints_scraped']})",
                      flush=True)  # fmt: skip
            measured, floor = recovery(svc, tmp)
        finally:
            svc.stop()
    print("job under the service vs bare torchrun (W=2, same spec)")
    print(f"  ratio service/bare, median of {len(ratios)} interleaved rounds: "
          f"{statistics.median(ratios):.3f}  (target >= 0.98)")  # fmt: skip
    print(f"  recovery (SIGKILL -> first step) {measured:.2f} s")
    print(f"  floor (fresh torchrun resuming that checkpoint -> first step) {floor:.2f} s")
    print(f"  ratio recovery/floor: {measured / floor:.2f}  (target <= 1.3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
