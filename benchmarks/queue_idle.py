"""Idle means idle: one job training next to a full queue, against the same job with none.

``python -m benchmarks.queue_idle [--queued 1000] [--rounds 5] [--seconds 30] [--quick]`` runs a
real ``elastrain serve`` of this checkout (embedded etcd, the local scheduler with
``ELASTRAIN_LOCAL_SLOTS=1``) and one real training job of 1 node x 1 process in its only slot.
Then, in interleaved rounds, it
measures over ``--seconds`` (a) the queue empty and (b) ``--queued`` real submissions waiting in
``QUEUED`` (the slot is full), cancelled again before the next (a): so from the second round on,
(a) also holds the cancelled jobs as finished ones. For each window: the training job's
samples/s (its workers' own progress events) and the service's and etcd's CPU (``/proc``).
Prints the ratio of samples/s queued / empty (target >= 0.95) and the service plus etcd CPU with
the queue full (target <= 0.1 of a core). The load generator (submits, cancels, one status
read a second) sleeps during the windows but shares the machine. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import record
from benchmarks.control_plane_scale import cpu_s, submit
from benchmarks.service_job import events_of, serving
from benchmarks.service_job import spec as training_spec
from service.reconciler import SWEEP_AGAIN_S
from tests.integration.launch import REPO
from tests.integration.worker.test_service_e2e import Service, until

TRAINING: dict[str, Any] = {
    "nodes": "1",
    "nproc_per_node": 1,
    "model": {"name": "mlp", "kwargs": {"hidden": 256, "depth": 2}},
    "grad_accum_steps": 1,
    "max_steps": 10**8,
    "log_every_steps": 5,  # a window of a few seconds holds many progress events
    "recovery": {"mode": "restart"},  # its rank 0 writes every progress event to the run dir
}
SETTLE_S = 5.5
"""After the queue changed: one idle pass more (every 5 s), so a window sees the queue as it stands."""


def window_rate(events: list[dict[str, Any]], start: float, end: float) -> float:
    """Samples/s between the first and the last progress event inside ``[start, end]`` (the
    workers' clock); nan when fewer than two fall inside. Pure."""
    inside = [e for e in events if e["event"] == "progress" and start <= e["time"] <= end]
    if len(inside) < 2 or inside[-1]["time"] <= inside[0]["time"]:
        return float("nan")
    first, last = inside[0], inside[-1]
    return float((last["samples_seen"] - first["samples_seen"]) / (last["time"] - first["time"]))


def measure(svc: Service, events: Path, seconds: float) -> tuple[float, float]:
    """One window: the training job's samples/s and the service's plus etcd's CPU in cores."""
    pids = (svc.proc.pid if svc.proc else 0, int((svc.data_dir / "etcd" / "etcd.pid").read_text()))
    start, cpu = time.time(), sum(cpu_s(p) for p in pids)
    time.sleep(seconds)
    end, used = time.time(), sum(cpu_s(p) for p in pids) - cpu
    return window_rate(events_of(events), start, end), used / (end - start)


async def cancel_all(svc: Service, ids: list[str]) -> None:
    """``DELETE /v1/jobs/{id}`` for each, 8 at a time."""
    gate = asyncio.Semaphore(8)
    async with httpx.AsyncClient(
        base_url=svc.url, headers={"Authorization": f"Bearer {svc.token}"}, timeout=60
    ) as client:

        async def one(job_id: str) -> None:
            async with gate:
                (await client.delete(f"/v1/jobs/{job_id}")).raise_for_status()

        await asyncio.gather(*(one(i) for i in ids))


def fill(svc: Service, queued: int) -> list[str]:
    """Submit ``queued`` jobs and wait until the last one waits in QUEUED and a pass settled."""
    ids, _ = asyncio.run(submit(svc.url, svc.token, [training_spec(name="queued", **TRAINING)] * queued))
    until(lambda: svc.job(ids[-1])["state"] == "QUEUED", "the last submission to be QUEUED", 300)
    time.sleep(SETTLE_S)
    return ids


def empty(svc: Service, ids: list[str]) -> None:
    """Cancel ``ids``; return once the service has also swept the ended jobs' keys a second time
    (``SWEEP_AGAIN_S`` after they ended), a one-off cost that is not the steady state measured."""
    asyncio.run(cancel_all(svc, ids))
    until(lambda: svc.job(ids[-1])["state"] == "CANCELLED", "the last queued job to be CANCELLED", 300)
    time.sleep(SWEEP_AGAIN_S + SETTLE_S)


def run(args: argparse.Namespace) -> tuple[list[float], list[float], list[float]]:
    """Per round: samples/s ratio queued / empty, CPU (cores) empty, CPU (cores) queued."""
    ratios, idle_cpu, full_cpu = [], [], []
    with (
        tempfile.TemporaryDirectory(prefix="elastrain-queue-idle-") as tmp,
        serving(Path(tmp) / "svc", {"ELASTRAIN_LOCAL_SLOTS": "1", "PYTHONPATH": str(REPO)}) as svc,
    ):
        body = training_spec(name="training", **TRAINING)
        job_id = svc.submit(body)
        until(lambda: (svc.job(job_id).get("step") or 0) >= 20, "the training job to step", 600)
        events = Path(svc.job(job_id)["checkpoint_dir"]) / "events.jsonl"
        for n in range(args.rounds):
            rate_a, cpu_a = measure(svc, events, args.seconds)
            ids = fill(svc, args.queued)
            rate_b, cpu_b = measure(svc, events, args.seconds)
            if n + 1 < args.rounds:
                empty(svc, ids)
            ratios.append(rate_b / rate_a)
            idle_cpu.append(cpu_a)
            full_cpu.append(cpu_b)
            print(
                f"round {n + 1}: samples/s {rate_a:.0f} with no job queued "
                f"({n * args.queued} finished), {rate_b:.0f} with {args.queued} queued: "
                f"{rate_b / rate_a:.3f}; service + etcd CPU {cpu_a:.3f} vs {cpu_b:.3f} cores",
                flush=True,
            )
        asyncio.run(cancel_all(svc, [job_id]))
    return ratios, idle_cpu, full_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queued", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--quick", action="store_true", help="50 queued, 1 round of 5 s windows")
    args = parser.parse_args()
    if args.quick:
        args.queued, args.rounds, args.seconds = 50, 1, 5.0
    ratios, idle_cpu, full_cpu = run(args)
    ratio, cpu = statistics.median(ratios), statistics.median(full_cpu)
    print(f"training samples/s, {args.queued} queued / none: {ratio:.3f} (target >= 0.95)")
    print(f"service + etcd CPU: {cpu:.3f} cores with {args.queued} queued (target <= 0.1), "
          f"{statistics.median(idle_cpu):.3f} with none")  # fmt: skip
    record.emit(
        f"training samples/s with {args.queued} jobs queued / with none (1 node x 1 process)",
        ratio, target=">= 0.95", rounds=ratios,
    )  # fmt: skip
    record.emit(  # the headline (the last record): the training job's ratio rides in its spread
        f"service + etcd CPU (cores) with one job training and {args.queued} queued",
        cpu, target="<= 0.1",
        spread=f"{record.spread_of(full_cpu)}; with none queued {statistics.median(idle_cpu):.3f}; "
        f"samples/s queued / none {ratio:.3f} (target >= 0.95)",
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
