"""The control plane at scale: N jobs x 10 nodes on the real service and a real etcd, the nodes
simulated.

``python -m benchmarks.control_plane_scale [--jobs 10 100] [--seconds 60] [--quick]`` starts
``elastrain serve``'s ``serve()`` in a child process (embedded etcd; the workers' calls on a port
of their own, ``ELASTRAIN_WORKER_PORT``, unless ``--one-port``) with :class:`SimScheduler`,
a scheduler that starts nothing and reports every node running; it is selected by this module's
hidden ``--serve`` entry point, which ships in no package. For each N it submits N jobs of 10
nodes x 1 process (submits/s), waits for their 10 x N launches, and then plays every rank over
the real worker callback routes as the workers do (``worker/report/service_client.py``): a
heartbeat per rank and progress from each job's rank 0 at the periods the service's answers ask
for (5 s and 2 s at the fastest, longer as the ranks grow: ``service/jobs/cadence.py``), a checkpoint
report from every rank every ``--checkpoint-s`` (a failed staging, ``ok: false``: the round is
kept in etcd and aborted, no files are needed). While they run it measures over ``--seconds``:
the reconciler's full passes' CPU and wall time (its own metrics), the service's and etcd's CPU
(``/proc``), etcd's database size and write rate (etcd's ``/metrics``), ``GET /v1/jobs/{id}``
and a page of ``GET /v1/jobs`` p99. ``--idle M`` adds a run of one playing job next to M finished jobs (the
scheduler reports nodes of jobs named ``finished`` as succeeded at once): what idle jobs cost.
The load generator shares the machine's cores with the service: the numbers are a ceiling on
what the service costs. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import sys
import tempfile
import time
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from benchmarks import record

HEARTBEAT_S, PROGRESS_S = 5.0, 2.0  # ServiceClient's periods until the service asks for others
STEPS_PER_S = 5.0
IDLE_PROBE_RATE = 0.5
NODES = 10


# ---------------------------------------------------------------- the arithmetic (pure)


def p99(values: list[float]) -> float:
    """The 99th percentile (nearest rank); nan for none. Pure."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def prom_value(text: str, name: str) -> float | None:
    """The sum of a Prometheus text series ``name`` over its labels (None when absent). Pure."""
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(float(v) for v in found) if found else None


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    """A Prometheus text series ``name`` summed by the value of one ``label``. Pure."""
    out: dict[str, float] = {}
    for labels, value in re.findall(rf"^{re.escape(name)}{{([^}}]*)}} (\S+)$", text, re.M):
        found = re.search(rf'{re.escape(label)}="([^"]*)"', labels)
        if found:
            out[found.group(1)] = out.get(found.group(1), 0.0) + float(value)
    return out


def per_pass_ms(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Mean pass time in ms between two (sum seconds, count) readings of a histogram. Pure."""
    passes = after[1] - before[1]
    return 1e3 * (after[0] - before[0]) / passes if passes > 0 else math.nan


def cost_ratio(small: tuple[int, float], large: tuple[int, float]) -> float:
    """Per-job pass cost at the large job count over that at the small one, from
    (jobs, pass ms) pairs: 1.0 is linear. Pure."""
    return (large[1] / large[0]) / (small[1] / small[0])


def history_s(retained_revisions: float, writes_per_s: float, *, horizon_s: float = 3600.0) -> float:
    """How many seconds of history etcd keeps when its compaction keeps ``retained_revisions``
    and every write is one revision; at most ``horizon_s``. Pure."""
    if writes_per_s <= 0:
        return horizon_s
    return min(horizon_s, retained_revisions / writes_per_s)


def db_after(
    now_bytes: float, growth_per_s: float, *, retention_s: float, horizon_s: float = 3600.0
) -> float:
    """etcd's database size after ``horizon_s``: it grows at ``growth_per_s`` (history kept) until
    compaction has history of ``retention_s`` to discard, then bbolt reuses the freed pages, so
    the file stops growing. Pure; a linear upper bound (no defragmentation assumed)."""
    return now_bytes + max(0.0, growth_per_s) * min(horizon_s, retention_s)


# ---------------------------------------------------------------- the simulated scheduler


class SimScheduler:
    """Starts nothing: every launch is appended to ``<dir>/launches.jsonl`` (job, node, launch id,
    worker token) for the load generator, and every node reports running, except those of jobs
    named ``finished``, which report succeeded (the job ends)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "launches.jsonl"
        self.done: set[str] = set()
        self.seen: dict[str, str] = {}
        self.handles: set[str] = set()

    def launch(self, node: Any) -> str:
        handle = f"sim://{node.launch_id}"
        if node.launch_id not in self.seen:
            self.seen[node.launch_id] = handle
            self.handles.add(handle)
            if node.spec.name == "finished":
                self.done.add(handle)
            line = {"job": node.job_id, "node": node.node_index, "launch_id": node.launch_id}
            line |= {"token": node.env["ELASTRAIN_WORKER_TOKEN"], "url": node.env["ELASTRAIN_SERVICE_URL"]}
            with self.path.open("a") as f:
                f.write(json.dumps(line) + "\n")
        return handle

    def status(self, handle: str) -> Any:
        from service.launch.protocol import NodeStatus

        if handle in self.done:
            return NodeStatus("succeeded", 0)
        return NodeStatus("running" if handle in self.handles else "unknown")

    def cancel(self, handle: str) -> None:
        return None

    def log_dir(self, handle: str) -> Path | None:
        return None

    def close(self) -> None:
        return None


def serve(port: int, data_dir: str) -> int:
    from service.server import serve as run
    from service.settings import load_settings

    # The simulated nodes take no cores: slots for every job the run submits (none waits in QUEUED).
    settings = load_settings(port=port, data_dir=data_dir, local_slots=65536)
    return run(settings, scheduler=SimScheduler(Path(data_dir)))


# ---------------------------------------------------------------- the simulated ranks


def spec(name: str = "sim") -> dict[str, Any]:
    return {
        "name": name,
        "model": {"name": "mlp"},
        "data": {"name": "synthetic"},
        "micro_batch_size": 8,
        "max_steps": 10_000_000,
        "nodes": str(NODES),
        "nproc_per_node": 1,
    }


class Wire:
    """POSTs and GETs over a pool of keep-alive connections (a minimal HTTP/1.1 client on
    asyncio streams: a client library costs more CPU than the service, on the same cores)."""

    def __init__(self, url: str, connections: int) -> None:
        self.parts = urlsplit(url)
        self.queue: asyncio.Queue[tuple[bytes, asyncio.Future[tuple[int, bytes]]]] = asyncio.Queue()
        self.connections = connections
        self.errors: dict[int, int] = {}
        self.sent = 0
        self.kinds: dict[str, int] = {}
        """Requests sent, by the path's last part (heartbeat, progress, checkpoints, ...)."""

    def request(self, method: str, path: str, token: str, body: bytes = b"") -> bytes:
        head = f"{method} {path} HTTP/1.1\r\nHost: {self.parts.netloc}\r\nAuthorization: Bearer {token}\r\n"
        if method == "POST":
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        return (head + "\r\n").encode() + body

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        """The answer's status and body."""
        done: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self.sent += 1
        kind = raw.split(b" ", 2)[1].split(b"?")[0].rsplit(b"/", 1)[-1].decode()
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        await self.queue.put((raw, done))
        return await done

    async def run(self) -> None:
        await asyncio.gather(*(self._conn() for _ in range(self.connections)))

    async def _conn(self) -> None:
        """One connection, opened at its first request and again whenever the service closed it
        (an idle keep-alive, a header deadline, ``connection: close``): the request is sent again."""
        conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        while True:
            raw, done = await self.queue.get()
            for attempt in range(3):
                if conn is None:
                    conn = await asyncio.open_connection(self.parts.hostname, self.parts.port)
                reader, writer = conn
                try:
                    writer.write(raw)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
                    body = await reader.readexactly(length)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    writer.close()
                    conn = None
                    if attempt == 2:
                        done.set_exception(exc)  # the caller fails, not hangs
                    continue
                if re.search(rb"(?i)connection:\s*close", head):
                    writer.close()
                    conn = None
                status = int(head.split(b" ", 2)[1])
                if status != 200:
                    self.errors[status] = self.errors.get(status, 0) + 1
                done.set_result((status, body))
                break


@dataclass
class Rank:
    job: str
    launch_id: str
    node: int
    token: str
    url: str
    """Where the service told the node to call."""


def checkpoint_round(job: str, now: float, *, t0: float, period: float) -> tuple[int, float]:
    """The newest checkpoint round of ``job`` begun by ``now``: (its index, when it began). Every
    rank of a job computes the same rounds (a job's own phase in the period, from its id), so
    its ranks report one step together, as a real job's do. Pure."""
    phase = (zlib.crc32(job.encode()) % 1000) / 1000 * period
    index = math.floor((now - t0 - phase) / period)
    return index, t0 + phase + index * period


async def play(wire: Wire, rank: Rank, stop: float, *, t0: float, checkpoint_s: float) -> None:
    """One rank: heartbeats, progress (node 0) and failed checkpoint reports, at the periods the
    service's answers ask for, as ``ServiceClient`` does."""
    base = f"/v1/jobs/{rank.job}/workers"
    periods = {"heartbeat_s": HEARTBEAT_S, "progress_s": PROGRESS_S}

    async def post(path: str, body: dict[str, Any]) -> None:
        status, answer = await wire.send(wire.request("POST", path, rank.token, json.dumps(body).encode()))
        if status == 200:
            ack = json.loads(answer)
            periods.update({k: float(ack[k]) for k in periods if k in ack})

    await asyncio.sleep(random.uniform(0, HEARTBEAT_S))
    if rank.node == 0:
        event = {"kind": "group_formed", "node_index": 0, "rank": 0, "group_id": "g", "world_size": NODES}
        await post(f"{base}/events", event)
    next_beat = next_progress = 0.0
    reported = checkpoint_round(rank.job, time.monotonic(), t0=t0, period=checkpoint_s)[0]
    while (now := time.monotonic()) < stop:
        step = int((now - t0) * STEPS_PER_S)
        if now >= next_beat:
            await post(f"{base}/heartbeat", {"launch_id": rank.launch_id, "local_rank": 0, "step": step})
            next_beat = now + periods["heartbeat_s"]
        if rank.node == 0 and now >= next_progress:
            body = {"step": step, "samples_seen": 8 * step, "samples_per_s": 8.0 * STEPS_PER_S}
            await post(f"{base}/progress", body | {"loss": 1.0, "world_size": NODES})
            next_progress = now + periods["progress_s"]
        index, began = checkpoint_round(rank.job, now, t0=t0, period=checkpoint_s)
        if index > reported:
            reported, at = index, int((began - t0) * STEPS_PER_S)
            report: dict[str, Any] = {"step": at, "generation": 0, "rank": rank.node, "ok": False}
            report |= {"world_size": NODES, "error": "simulated", "files": {}, "pieces": [], "tensors": {}}
            report |= {"meta_digest": "", "rank_meta": {}, "context": {}}
            await post(f"{base}/checkpoints?seq=0", report)
        due = min(next_beat, next_progress) if rank.node == 0 else next_beat
        await asyncio.sleep(max(0.05, min(due, began + checkpoint_s) - now))


def probe(url: str, token: str, jobs: list[str], stop: float, per_s: float) -> dict[str, list[float]]:
    """GET a random job and a page of jobs, ``per_s`` each per second until ``time.monotonic()``
    is ``stop`` (one clock for every process of the machine); latencies in s. Runs in a process
    of its own (:func:`probing`): a user's GET does not wait on the load generator's event loop,
    which holds thousands of simulated ranks."""
    lat: dict[str, list[float]] = {"job": [], "page": []}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as http:
        while time.monotonic() < stop:
            for kind, path in (("job", f"/v1/jobs/{random.choice(jobs)}"), ("page", "/v1/jobs?limit=50")):
                t0 = time.perf_counter()
                http.get(path).raise_for_status()
                lat[kind].append(time.perf_counter() - t0)
            time.sleep(1.0 / per_s)
    return lat


async def probing(url: str, token: str, jobs: list[str], stop: float, per_s: float) -> dict[str, list[float]]:
    """:func:`probe` in a new process (spawned: nothing of this loop's state crosses)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return await asyncio.wrap_future(pool.submit(probe, url, token, jobs, stop, per_s))


# ---------------------------------------------------------------- one run


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process, from ``/proc``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample(url: str, etcd: str, pids: tuple[int, int]) -> dict[str, float]:
    """The service's pass histogram, etcd's size and revision, both processes' CPU, now."""
    service = httpx.get(f"{url}/metrics", timeout=30).text
    store = httpx.get(f"{etcd}/metrics", timeout=30).text
    return {
        "time": time.monotonic(),
        "pass_sum": prom_value(service, "elastrain_reconciler_pass_duration_seconds_sum") or 0.0,
        "pass_cpu": prom_value(service, "elastrain_reconciler_pass_cpu_seconds_total") or 0.0,
        "pass_count": prom_value(service, "elastrain_reconciler_pass_duration_seconds_count") or 0.0,
        "round_trips": by_label(service, "elastrain_etcd_requests_total", "op"),
        "heartbeat_s": prom_value(service, "elastrain_worker_heartbeat_period_seconds") or math.nan,
        "progress_s": prom_value(service, "elastrain_worker_progress_period_seconds") or math.nan,
        "db": prom_value(store, "etcd_mvcc_db_total_size_in_bytes") or math.nan,
        "revision": prom_value(store, "etcd_debugging_mvcc_current_revision") or math.nan,
        "service_cpu": cpu_s(pids[0]),
        "etcd_cpu": cpu_s(pids[1]),
    }


async def submit(url: str, token: str, bodies: list[dict[str, Any]]) -> tuple[list[str], float]:
    """Submit every body, 8 at a time; the job ids and submits per second."""
    headers = {"Authorization": f"Bearer {token}"}
    gate = asyncio.Semaphore(8)
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:

        async def one(body: dict[str, Any]) -> str:
            async with gate:
                for _ in range(30):  # 503 (a leader not elected yet) and 429 say: again
                    answer = await client.post(f"{url}/v1/jobs", json=body)
                    if answer.status_code not in (429, 503):
                        break
                    await asyncio.sleep(1.0)
                answer.raise_for_status()
                return str(answer.json()["id"])

        t0 = time.perf_counter()
        ids = await asyncio.gather(*(one(b) for b in bodies))
        return list(ids), len(bodies) / (time.perf_counter() - t0)


def wait_launches(path: Path, count: int, timeout_s: float) -> list[Rank]:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count or time.monotonic() > deadline:
            raw = [json.loads(line) for line in lines]
            return [Rank(r["job"], r["launch_id"], r["node"], r["token"], r["url"]) for r in raw]
        time.sleep(0.5)


async def drive(
    url: str, token: str, ranks: list[Rank], jobs: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """Play the ranks for a warm-up and ``args.seconds``; the two samples and the GET latencies."""
    etcd = "http://127.0.0.1:{client_port}".format(
        **json.loads((args.workdir / "etcd" / "ports.json").read_text())
    )
    pids = (args.proc.pid, int((args.workdir / "etcd" / "etcd.pid").read_text()))
    wire = Wire(ranks[0].url, args.connections)  # every node is told the same URL
    runner = asyncio.create_task(wire.run())
    t0 = time.monotonic()
    stop = t0 + args.warmup + args.seconds
    players = [asyncio.create_task(play(wire, r, stop, t0=t0, checkpoint_s=args.checkpoint_s)) for r in ranks]
    await asyncio.sleep(args.warmup)
    first = await asyncio.to_thread(sample, url, etcd, pids)
    first |= {"load_cpu": time.process_time(), "sent": wire.sent, "kinds": dict(wire.kinds)}
    lat = await probing(url, token, jobs, stop, args.probe_rate)
    last = await asyncio.to_thread(sample, url, etcd, pids)
    last |= {"load_cpu": time.process_time(), "sent": wire.sent, "kinds": dict(wire.kinds)}
    await asyncio.gather(*players)
    runner.cancel()
    calls = "the API's port" if ranks[0].url == url else "a port of their own (ELASTRAIN_WORKER_PORT)"
    return {"first": first, "last": last, "lat": lat, "errors": wire.errors, "calls": calls}


def report(
    label: str, jobs: int, out: dict[str, Any], submits: float | None, retained: float
) -> tuple[float, float, float]:
    """Print one run's numbers; returns the full passes' mean CPU time in ms (their cost: their
    wall time also holds their waits for the interpreter while it serves requests) and the
    p99s of ``GET /v1/jobs/{id}`` and of a page, in ms."""
    a, b = out["first"], out["last"]
    span = b["time"] - a["time"]
    ms = per_pass_ms((a["pass_sum"], a["pass_count"]), (b["pass_sum"], b["pass_count"]))
    cpu = per_pass_ms((a["pass_cpu"], a["pass_count"]), (b["pass_cpu"], b["pass_count"]))
    svc, etc = ((b[k] - a[k]) / span for k in ("service_cpu", "etcd_cpu"))
    writes, growth = (b["revision"] - a["revision"]) / span, (b["db"] - a["db"]) / span
    kept = history_s(retained, writes)
    hour = db_after(b["db"], growth, retention_s=kept)
    lat, passes = out["lat"], b["pass_count"] - a["pass_count"]
    print(f"{label}: {jobs} jobs x {NODES} nodes ({os.cpu_count()} cores shared with the load generator)")
    print(f"  workers call {out['calls']}")
    print(
        f"  reconciler full pass: {cpu:.1f} ms CPU ({cpu / jobs:.3f} ms per job), {ms:.1f} ms wall "
        f"({ms / jobs:.3f} ms per job), mean of {passes:.0f}"
    )
    print(f"  CPU: service {svc:.2f} + etcd {etc:.2f} = {svc + etc:.2f} cores")
    trips = {op: (n - a["round_trips"].get(op, 0.0)) / span for op, n in b["round_trips"].items()}
    ops = ", ".join(f"{op} {n:.0f}" for op, n in sorted(trips.items(), key=lambda t: -t[1]) if n >= 0.5)
    print(f"  the service's etcd round trips: {sum(trips.values()):.0f}/s ({ops})")
    beat, progress = b["heartbeat_s"], b["progress_s"]
    print(f"  workers asked for a heartbeat every {beat:g} s, progress every {progress:g} s")
    print(
        f"  etcd: db {b['db'] / 2**20:.1f} MiB, {writes:.0f} revisions/s, grows {growth / 2**10:.1f} KiB/s; "
        f"after an hour <= {hour / 2**20:.0f} MiB ({retained:.0f} revisions kept: {kept:.0f} s)"
    )
    print(
        f"  p99: GET /v1/jobs/{{id}} {1e3 * p99(lat['job']):.1f} ms, GET /v1/jobs?limit=50 "
        f"{1e3 * p99(lat['page']):.1f} ms ({len(lat['job'])} each)"
    )
    sent, load = b["sent"] - a["sent"], b["load_cpu"] - a["load_cpu"]
    kinds = {k: (n - a["kinds"].get(k, 0)) / span for k, n in b["kinds"].items()}
    kinds_line = ", ".join(f"{k} {n:.0f}" for k, n in sorted(kinds.items(), key=lambda t: -t[1]) if n >= 0.5)
    print(
        f"  load generator: {sent / span:.0f} requests/s ({kinds_line}), {load / span:.2f} cores, "
        f"{1e3 * load / max(sent, 1):.3f} ms CPU a request"
    )
    if submits is not None:
        print(f"  submits: {submits:.1f}/s")
    if out["errors"]:
        print(f"  non-200 answers: {out['errors']}")
    return cpu, 1e3 * p99(lat["job"]), 1e3 * p99(lat["page"])


def one_run(args: argparse.Namespace, playing: int, finished: int, label: str) -> tuple[float, float, float]:
    from benchmarks.service_api import start_service
    from service.ports import free_port

    settings = {} if args.one_port else {"ELASTRAIN_WORKER_PORT": str(free_port())}
    with tempfile.TemporaryDirectory(prefix="elastrain-scale-") as tmp:
        args.workdir = Path(tmp)
        args.proc, url, token = start_service(
            args.workdir, module="benchmarks.control_plane_scale", settings=settings
        )
        try:
            done, _ = asyncio.run(submit(url, token, [spec("finished")] * finished))
            ids, rate = asyncio.run(submit(url, token, [spec()] * playing))
            launches = NODES * (playing + finished)
            ranks = wait_launches(args.workdir / "launches.jsonl", launches, 120 + launches / 10)
            ranks = [r for r in ranks if r.job in set(ids)]
            out = asyncio.run(drive(url, token, ranks, ids + done, args))
            return report(
                label, playing + finished, out, rate if not finished else None, args.retained_revisions
            )
        finally:
            args.proc.terminate()
            args.proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="*", default=[10, 100])
    parser.add_argument(
        "--idle", type=int, default=0, help="also: one playing job next to this many finished"
    )
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument(
        "--warmup",
        type=float,
        default=45.0,
        help="s before measuring (the ranks take up the periods the service asks for)",
    )
    parser.add_argument("--checkpoint-s", type=float, default=60.0)
    parser.add_argument("--probe-rate", type=float, default=10.0, help="GETs of each kind per second")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument(
        "--one-port",
        action="store_true",
        help="workers call the API's port (default: a port of their own, as the chart deploys)",
    )
    parser.add_argument(
        "--retained-revisions", type=float, default=10_000, help="the embedded etcd's compaction retention"
    )
    parser.add_argument(
        "--quick", action="store_true", help="5 and 20 jobs, 5 s each, a full pass a second (make bench)"
    )
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.data_dir)
    if args.quick:
        args.jobs, args.seconds, args.warmup, args.checkpoint_s = [5, 20], 5.0, 2.0, 5.0
        # a full pass a second (not every 5 s), so that 5 s hold enough passes to time
        os.environ["ELASTRAIN_RECONCILE_IDLE_INTERVAL_S"] = "1"
    runs = [(n, one_run(args, n, 0, "playing")) for n in args.jobs]
    passes = [(n, cpu) for n, (cpu, _, _) in runs]
    ratios = []
    for small, large in itertools.pairwise(passes):
        ratio = cost_ratio(small, large)
        ratios.append(ratio)
        print(f"pass CPU per job at {large[0]} vs {small[0]} jobs: {ratio:.2f}x (target <= 1.3)")
    if ratios:
        record.emit(
            f"reconciler pass CPU per job at {args.jobs[-1]} vs {args.jobs[-2]} jobs (x 10 simulated nodes)",
            ratios[-1],
            target="<= 1.3",
            spread=f"one run of {args.seconds:g} s a size; at {runs[-1][0]} jobs p99 GET /v1/jobs/{{id}} "
            f"{runs[-1][1][1]:.0f} ms (target <= 50), a page {runs[-1][1][2]:.0f} ms (target <= 100)",
        )
    if args.idle:
        args.probe_rate = min(args.probe_rate, IDLE_PROBE_RATE)  # the GETs would be most of the cost
        one_run(args, 1, args.idle, "one playing job next to finished ones")
    return 0


if __name__ == "__main__":
    sys.exit(main())
