"""The etcd client's cost per request (worker/etcdclient.py), against its floor.

A real embedded etcd; each round sends the same requests (a put, a range, a transaction) through

* ``floor``: one ``http.client`` connection, the request's bytes made once: what any client
  must spend (the socket calls, reading and parsing the answer);
* ``elastrain``: ``EtcdClient`` (its pool, failover bookkeeping, the JSON body made per call);
* ``requests``: a ``requests`` session, the transport the client had before (etcd3gw's).

Rounds interleave the three; the CPU of this process per request (user + system, from
``getrusage``: the part that competes with training on the workers' cores) and the wall time per
request are printed as medians with their spread, and the client's ratio to the floor.

``python -m benchmarks.etcd_client [--rounds 5] [--requests 500]``
"""

from __future__ import annotations

import argparse
import http.client
import json
import resource
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import requests

from benchmarks.record import emit
from benchmarks.stats import spread
from service.etcd.server import EtcdServer
from worker.etcdclient import EtcdClient, EtcdEndpoint, b64, put_request

Sender = Callable[[str, dict[str, object]], object]


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def requests_body() -> list[tuple[str, dict[str, object]]]:
    put = put_request("/bench/key", b"x" * 200)
    return [
        ("kv/put", put),
        ("kv/range", {"key": b64("/bench/key")}),
        ("kv/txn", {"compare": [], "success": [{"request_put": put}]}),
    ]


def floor_sender(endpoint: EtcdEndpoint) -> Sender:
    conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=5)
    encoded: dict[str, bytes] = {}

    def send(path: str, body: dict[str, object]) -> object:
        data = encoded.setdefault(path, json.dumps(body).encode())
        conn.request("POST", "/v3/" + path, body=data, headers={"Content-Type": "application/json"})
        return json.loads(conn.getresponse().read())

    return send


def client_sender(endpoint: EtcdEndpoint) -> Sender:
    client = EtcdClient([endpoint])
    return lambda path, body: client.post(path, body)


def requests_sender(endpoint: EtcdEndpoint) -> Sender:
    session = requests.Session()
    return lambda path, body: session.post(f"{endpoint.url}/v3/{path}", json=body, timeout=5).json()


def measure(send: Sender, n: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per request over ``n`` requests of the three kinds in turn."""
    bodies = requests_body()
    for path, body in bodies:  # warm: the connection open
        send(path, body)
    c0, t0 = cpu_s(), time.perf_counter()
    for i in range(n):
        path, body = bodies[i % len(bodies)]
        send(path, body)
    return 1000 * (cpu_s() - c0) / n, 1000 * (time.perf_counter() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EtcdServer(tmp) as server:
        endpoint = EtcdEndpoint.from_url(server.endpoint)
        senders = {"floor": floor_sender(endpoint), "elastrain": client_sender(endpoint),
                   "requests": requests_sender(endpoint)}  # fmt: skip
        cpu: dict[str, list[float]] = defaultdict(list)
        wall: dict[str, list[float]] = defaultdict(list)
        for r in range(args.rounds):
            order = list(senders) if r % 2 == 0 else list(reversed(senders))
            for name in order:
                c, w = measure(senders[name], args.requests)
                cpu[name].append(c)
                wall[name].append(w)
            print(f"round {r}: " + ", ".join(f"{k} {cpu[k][-1]:.3f}/{wall[k][-1]:.3f} ms" for k in senders))
    print(f"per request, {args.rounds} rounds of {args.requests} (a put, a range, a txn in turn):")
    for name in senders:
        print(f"  {name:9s} CPU ms {spread(cpu[name], 3)}; wall ms {spread(wall[name], 3)}")
    ratios = [c / f for c, f in zip(cpu["elastrain"], cpu["floor"], strict=True)]
    before = [c / f for c, f in zip(cpu["requests"], cpu["elastrain"], strict=True)]
    print(f"elastrain / floor (CPU): {spread(ratios)}; requests / elastrain (CPU): {spread(before)}")
    print(f"median wall: elastrain {statistics.median(wall['elastrain']):.3f} ms, "
          f"requests {statistics.median(wall['requests']):.3f} ms")  # fmt: skip
    emit("CPU per request, EtcdClient / bare http.client", statistics.median(ratios), rounds=ratios)


if __name__ == "__main__":
    main()
