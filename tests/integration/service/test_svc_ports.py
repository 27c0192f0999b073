"""The port picker against the kernel: the ports it hands out bind, avoid the ephemeral range
and never repeat, and a port someone else holds is not handed out. (Its pure parts are
tests/unit/service/server/test_ports.py.)"""

from __future__ import annotations

import socket

import pytest

from service import ports

pytestmark = pytest.mark.integration


def test_free_ports_bind_avoid_the_ephemeral_range_and_never_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (32768, 60999))
    picked = [ports.free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)
    assert all(10000 <= p < 32768 for p in picked)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", picked[-1]))  # free when handed out


def test_a_port_taken_meanwhile_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_range", lambda: (taken + 1, taken + 1))
        monkeypatch.setattr(ports, "candidate_range", lambda _r: (taken, taken + 1))
        # the only candidate is bound by someone else: fall back to a kernel-chosen port
        got = ports.free_port()
    assert got != taken
