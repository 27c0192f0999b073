"""Control-plane load: ``GET /v1/jobs/{id}`` throughput and latency, and 100 concurrent
submissions with one Idempotency-Key.

``python -m benchmarks.service_api [--seconds 10] [--concurrency 16] [--rate 1000]`` starts
``elastrain serve`` (embedded etcd, a scheduler that launches nothing) in a child process on a
free port, submits one job, then drives GET requests over keep-alive connections: once as fast
as possible (the ceiling), once paced at ``--rate`` (the target: sustained >= 1000 req/s with
p99 < 50 ms). Prints requests/s, p50/p99 latency and ratios to the target, then the result of
100 concurrent submissions with one Idempotency-Key, and last a worker's heartbeat POSTed to the
leader directly and through a standby instance that forwards it (the cost of the extra hop). The
client shares the machine's cores with the service, so the numbers are a floor. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from benchmarks.record import emit

REPO = Path(__file__).resolve().parents[1]
SPEC = {
    "name": "bench",
    "model": {"name": "mlp"},
    "data": {"name": "synthetic"},
    "micro_batch_size": 8,
    "max_steps": 100,
    "nodes": "1:4",
}


class IdleScheduler:
    """Launches nothing; every node reports running."""

    def launch(self, node: Any) -> str:
        return f"idle://{node.launch_id}"

    def status(self, handle: str) -> Any:
        from service.launch.protocol import NodeStatus

        return NodeStatus("running")

    def cancel(self, handle: str) -> None:
        return None

    def log_dir(self, handle: str) -> Path | None:
        return None

    def close(self) -> None:
        return None


def serve(port: int, data_dir: str, etcd: str = "") -> int:
    from service.server import serve as run
    from service.settings import load_settings

    # nothing runs: slots for every job, none waits in the queue
    settings = load_settings(port=port, data_dir=data_dir, etcd=etcd, local_slots=1024)
    return run(settings, scheduler=IdleScheduler())


def start_service(
    workdir: Path,
    *,
    etcd: str = "",
    token: str | None = None,
    etcd_password: str | None = None,
    module: str = "benchmarks.service_api",
    settings: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], str, str]:
    """``elastrain serve`` in a child process: on its own embedded etcd, or on ``etcd`` (then
    with the API token ``token``, as replicas share one, and etcd's root password); ``module``:
    the benchmark whose hidden ``--serve`` entry point runs it with that benchmark's scheduler;
    ``settings``: more ``ELASTRAIN_*`` variables of the service's."""
    from service.ports import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("ELASTRAIN_API_TOKEN", None)
    if token is not None:
        env["ELASTRAIN_API_TOKEN"] = token
    if etcd_password is not None:
        env["ELASTRAIN_ETCD_PASSWORD"] = etcd_password
    env |= settings or {}
    cmd = [sys.executable, "-m", module, "--serve", str(port), "--data-dir", str(workdir)]
    cmd += ["--etcd", etcd] if etcd else []
    log = open(workdir / "service.log", "wb")  # noqa: SIM115 - the child owns it
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url, token or (workdir / "api-token").read_text().strip()
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"service did not start: {(workdir / 'service.log').read_text()[-2000:]}")


async def hammer(
    url: str, headers: dict[str, str], seconds: float, concurrency: int, rate: float = 0.0
) -> list[float]:
    """GET ``url`` over ``concurrency`` keep-alive connections for ``seconds``; latencies in s.
    With ``rate`` the requests are paced to that many per second in total, and each latency
    counts from the request's scheduled time (so queueing behind a slow one is not hidden).

    A minimal HTTP/1.1 client on asyncio streams: a full client library costs more CPU per
    request than the service does, and it shares the same cores.
    """
    parts = urlsplit(url)
    head = f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    request = head.encode()
    latencies: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def worker(index: int) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        period = concurrency / rate if rate else 0.0
        next_at = time.perf_counter() + index * period / concurrency
        try:
            while time.perf_counter() < stop:
                if period:
                    await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                    t0, next_at = next_at, next_at + period
                else:
                    t0 = time.perf_counter()
                writer.write(request)
                status_and_headers = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in status_and_headers.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                errors += not status_and_headers.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    if errors:
        print(f"  {errors} non-200 responses")
    return latencies


def wrk(url: str, token: str, seconds: float, connections: int, rate: float, workdir: Path) -> str | None:
    """The same GETs from ``wrk`` (C, one thread: far less client CPU on the shared cores), when
    it is installed (Debian: ``apt-get install wrk``; ``make bench`` does). Paced runs use its
    ``delay()`` hook: each connection waits ``connections / rate`` between requests, so the rate is
    at most ``rate`` (a closed loop with think time; latency excludes the wait)."""
    binary = shutil.which("wrk")
    if binary is None:
        return None
    script = workdir / f"wrk-{rate:.0f}.lua"
    lines = [f'wrk.headers["Authorization"] = "Bearer {token}"']
    if rate:
        lines.append(f"function delay() return {1000.0 * connections / rate:.3f} end")
    script.write_text("\n".join(lines) + "\n")
    cmd = [binary, "-t1", f"-c{connections}", f"-d{seconds:.0f}s", "--latency", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    found = {m.group(1): m.group(2) for m in re.finditer(r"^\s+(50|99)%\s+(\S+)$", out, re.M)}
    rps = re.search(r"^Requests/sec:\s+(\S+)$", out, re.M)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if not (found and rps):
        return f"wrk gave no result: {out[-300:]}"
    how = f"paced at {rate:,.0f}/s" if rate else "as fast as possible"
    extra = f", {errors.group(1)} non-2xx" if errors else ""
    return (
        f"wrk: GET /v1/jobs/{{id}} {how}: {float(rps.group(1)):,.0f} req/s, p50 {found['50']}, "
        f"p99 {found['99']} ({connections} connections{extra})"
    )


def forwarded_writes(leader: str, standby: str, token: str, job_id: str, n: int, rounds: int) -> str:
    """A rank's heartbeat POSTed to the leader directly and through the standby, which forwards
    it; alternating rounds of ``n`` sequential requests (one keep-alive connection each)."""
    headers = {"Authorization": f"Bearer {token}"}
    beat = {"launch_id": f"{job_id}-n0-a0", "local_rank": 0, "step": 1}
    lat: dict[str, list[float]] = {"leader": [], "standby": []}
    with (
        httpx.Client(headers=headers, timeout=30) as direct,
        httpx.Client(headers=headers, timeout=30) as via,
    ):
        for index in range(2 * rounds):
            side = ("leader", "standby")[(index + index // 2) % 2]  # ABBA
            client, url = (direct, leader) if side == "leader" else (via, standby)
            for _ in range(n):
                t0 = time.perf_counter()
                answer = client.post(f"{url}/v1/jobs/{job_id}/workers/heartbeat", json=beat)
                lat[side].append(time.perf_counter() - t0)
                if answer.status_code != 200:
                    return f"forwarded writes: {side} answered {answer.status_code}: {answer.text[:200]}"
    p50 = {k: statistics.median(v) * 1e3 for k, v in lat.items()}
    p99 = {k: statistics.quantiles(v, n=100)[98] * 1e3 for k, v in lat.items()}
    return (
        f"POST heartbeat, {n * rounds} each: to the leader p50 {p50['leader']:.2f} ms, p99 "
        f"{p99['leader']:.2f} ms; through the standby p50 {p50['standby']:.2f} ms, p99 "
        f"{p99['standby']:.2f} ms (x{p50['standby'] / p50['leader']:.2f} p50: one more hop)"
    )


async def idempotent_submits(url: str, token: str, n: int) -> tuple[int, int]:
    headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": f"bench-{time.time_ns()}"}
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        responses = await asyncio.gather(*(client.post(f"{url}/v1/jobs", json=SPEC) for _ in range(n)))
    ids = {r.json()["id"] for r in responses if r.status_code in (200, 201)}
    return len(ids), sum(r.status_code == 201 for r in responses)


def start_standby(workdir: Path, token: str) -> tuple[subprocess.Popen[bytes], str, str]:
    """A second instance on the first one's embedded etcd: it stands by while the first leads."""
    ports = json.loads((workdir / "etcd" / "ports.json").read_text())
    (workdir / "standby").mkdir()
    root = (workdir / "etcd-root-password").read_text().strip()  # the embedded etcd has auth on
    standby = start_service(
        workdir / "standby", etcd=f"http://127.0.0.1:{ports['client_port']}", token=token, etcd_password=root
    )
    if httpx.get(f"{standby[1]}/readyz", timeout=5).json().get("leader"):
        raise SystemExit("the second instance leads: the first lost its lease")
    return standby


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rate", type=float, default=1000.0, help="paced run: requests per second")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--etcd", default="", help=argparse.SUPPRESS)
    parser.add_argument("--forward-rounds", type=int, default=4, help="rounds of forwarded writes (0: skip)")
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.data_dir, args.etcd)
    with tempfile.TemporaryDirectory(prefix="elastrain-bench-") as tmp:
        proc, url, token = start_service(Path(tmp))
        try:
            headers = {"Authorization": f"Bearer {token}"}
            job = httpx.post(f"{url}/v1/jobs", json=SPEC, headers=headers, timeout=30).json()
            target = f"{url}/v1/jobs/{job['id']}"
            asyncio.run(hammer(target, headers, 1.0, args.concurrency))  # warm up
            paced = (0.0, 0.0, 0.0)
            for rate in (0.0, args.rate):
                lat = asyncio.run(hammer(target, headers, args.seconds, args.concurrency, rate))
                achieved = len(lat) / args.seconds
                p50, p99 = statistics.median(lat) * 1e3, statistics.quantiles(lat, n=100)[98] * 1e3
                how = f"paced at {rate:,.0f}/s" if rate else "as fast as possible"
                print(
                    f"GET /v1/jobs/{{id}} {how}: {achieved:,.0f} req/s, p50 {p50:.1f} ms, p99 {p99:.1f} ms "
                    f"({args.concurrency} connections; {os.cpu_count()} cores shared with the client)"
                )
                print(
                    f"  vs target (>= 1000 req/s, p99 < 50 ms): "
                    f"{achieved / 1000:.2f}x rate, {p99 / 50:.2f}x p99"
                )
                paced = (achieved, p50, p99)
            for rate in (0.0, args.rate):
                line = wrk(target, token, args.seconds, args.concurrency, rate, Path(tmp))
                print(line or "wrk is not installed (apt-get install wrk): only the asyncio client ran")
            jobs, created = asyncio.run(idempotent_submits(url, token, 100))
            print(f"100 concurrent submissions, one Idempotency-Key: {jobs} job(s), {created} answered 201")
            if args.forward_rounds:
                standby = start_standby(Path(tmp), token)
                try:
                    print(forwarded_writes(url, standby[1], token, job["id"], 250, args.forward_rounds))
                finally:
                    standby[0].terminate()
                    standby[0].wait(timeout=30)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    emit(f"p99 latency (ms) of GET /v1/jobs/{{id}} paced at {args.rate:,.0f}/s", paced[2], target="< 50",
         spread=f"{paced[0]:,.0f} req/s achieved, p50 {paced[1]:.1f} ms, {args.seconds:g} s run")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
