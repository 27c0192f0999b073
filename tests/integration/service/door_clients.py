"""Hostile clients of the service for one window, in a process of their own (standing in for
other machines; raw sockets and the standard library only, so that they start in milliseconds
and cost little CPU of their own beside the job).

``--flood`` threads each post ``--bodies`` ~1 MiB JSON bodies without a token, at most ten a
second, on a kept-alive connection; meanwhile ``--half`` connections each hold half a request
(half the headers, or the headers and half a body) and are opened again when the server closes
them. When the bodies are sent it prints ``{"window": "over"}``, then waits at most ``--grace``
seconds for the server to close the half requests still held, and prints one JSON line: the
status of every flood answer, how many half requests the server closed during the window, how
many were held at its end and how many of those stayed open.
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import threading
import time

BODY = json.dumps(list(range(140_000))).encode()
HALVES = (
    b"POST /v1/jobs HTTP/1.1\r\nHost: svc\r\nContent-Type: application/json\r\nContent-Le",
    b'POST /v1/jobs HTTP/1.1\r\nHost: svc\r\nContent-Length: 1000\r\n\r\n{"name": ',
)


def flood(port: int, bodies: int, statuses: list[int]) -> None:
    request = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: svc\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
    )
    sock: socket.socket | None = None
    for _ in range(bodies):
        sent = time.monotonic()
        try:
            sock = sock or socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(request)
            statuses.append(_status(sock))
        except OSError:
            statuses.append(0)
            sock = None
        time.sleep(max(0.0, 0.1 - (time.monotonic() - sent)))


def _status(sock: socket.socket) -> int:
    """Read one answer (headers and a Content-Length body); its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    length = next(
        int(v)
        for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
        if k.lower() == b"content-length"
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split(b" ", 2)[1])


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (its answer, if any, read to the end)."""
    try:
        while sock.recv(65536):
            if not select.select([sock], [], [], 0.5)[0]:
                return False
    except ConnectionResetError:
        pass
    return True


def half_requests(port: int, count: int, over: threading.Event, grace_s: float) -> dict[str, int]:
    held: set[socket.socket] = set()
    cut = 0

    def open_one(i: int) -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(HALVES[i % 2])
        held.add(sock)

    for i in range(count):
        open_one(i)
    while not over.is_set():
        for sock in select.select(list(held), [], [], 0.2)[0]:
            if closed_by_server(sock):
                held.discard(sock)
                sock.close()
                cut += 1
                open_one(cut)
    at_end = len(held)
    print(json.dumps({"window": "over"}), flush=True)
    deadline = time.monotonic() + grace_s
    while held and time.monotonic() < deadline:
        for sock in select.select(list(held), [], [], 0.2)[0]:
            if closed_by_server(sock):
                held.discard(sock)
                sock.close()
    return {"cut": cut, "held_at_end": at_end, "still_open": len(held)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bodies", type=int, default=30)
    parser.add_argument("--flood", type=int, default=4)
    parser.add_argument("--half", type=int, default=300)
    parser.add_argument("--grace", type=float, default=10.0)
    args = parser.parse_args()
    statuses: list[int] = []
    over = threading.Event()
    threads = [
        threading.Thread(target=flood, args=(args.port, args.bodies, statuses)) for _ in range(args.flood)
    ]
    for t in threads:
        t.start()

    def end_window() -> None:
        for t in threads:
            t.join()
        over.set()

    threading.Thread(target=end_window).start()
    summary = half_requests(args.port, args.half, over, args.grace)
    print(json.dumps({"statuses": statuses, **summary}), flush=True)


if __name__ == "__main__":
    main()
