"""Free TCP ports for the processes we start (embedded etcd, uvicorn in tests and the demo).

``bind(port 0)`` hands out a port from the kernel's ephemeral range, and every outgoing
connection on the machine draws its local port from that same range. Between "this port was
free" and "the child listens on it" (an etcd or uvicorn start takes seconds) a connection can take
it as its source port, and the child dies with "address already in use". CI hit exactly that: a
3-member etcd cluster lost a member to a peer connection that had taken the member's port.

So :func:`free_port` picks from below the ephemeral range, where only a process that binds a port
on purpose takes it, checks that the port binds right now, and never hands the same port out twice
in one process. A caller that listens later can still lose a race to another program binding the
same port on purpose; callers that start servers retry on a fresh port.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below this sit the well-known and registered ports people run services on
_TRIES = 200

_given: set[int] = set()
_lock = threading.Lock()


def parse_port_range(text: str) -> tuple[int, int] | None:
    """``"32768\\t60999\\n"`` → ``(32768, 60999)``; ``None`` if the text is not two ports."""
    parts = text.split()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    low, high = int(parts[0]), int(parts[1])
    return (low, high) if 0 < low <= high < 65536 else None


def candidate_range(ephemeral: tuple[int, int] | None) -> tuple[int, int] | None:
    """The half-open range ``[start, stop)`` to draw from: the ports between ``_LOWEST`` and the
    ephemeral range, or above it when it starts too low to leave room. ``None``: no such room
    (or the ephemeral range is unknown), and the caller falls back to ``bind(0)``."""
    if ephemeral is None:
        return None
    low, high = ephemeral
    if low - _LOWEST >= 1000:
        return _LOWEST, low
    if 65536 - (high + 1) >= 1000:
        return high + 1, 65536
    return None


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        return parse_port_range(_RANGE_FILE.read_text())
    except OSError:
        return None


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that binds now, from outside the ephemeral range when the machine
    leaves room for it, and not handed out before by this process."""
    span = candidate_range(_ephemeral_range())
    rng = random.SystemRandom()
    with _lock:
        if span is not None:
            for _ in range(_TRIES):
                port = rng.randrange(*span)
                if port not in _given and _binds(host, port):
                    _given.add(port)
                    return port
        for _ in range(_TRIES):
            port = _kernel_port(host)
            if port not in _given:
                _given.add(port)
                return port
    raise OSError(f"no free TCP port on {host} after {2 * _TRIES} tries")
