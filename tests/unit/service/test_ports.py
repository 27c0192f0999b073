"""The port picker: outside the kernel's ephemeral range, bindable, never the same port twice."""

from __future__ import annotations

import socket

import pytest

from service import ports


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("32768\t60999\n", (32768, 60999)),
        ("1024 65535", (1024, 65535)),
        ("", None),
        ("a b", None),
        ("60999 32768", None),
        ("0 100", None),
        ("1 2 3", None),
    ],
)
def test_parse_port_range(text: str, expected: tuple[int, int] | None) -> None:
    assert ports.parse_port_range(text) == expected


def test_candidate_range_is_below_or_above_the_ephemeral_range() -> None:
    assert ports.candidate_range((32768, 60999)) == (10000, 32768)
    assert ports.candidate_range((1024, 40000)) == (40001, 65536)  # no room below: above
    assert ports.candidate_range((1024, 65535)) is None  # no room at all: the kernel picks
    assert ports.candidate_range(None) is None


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
