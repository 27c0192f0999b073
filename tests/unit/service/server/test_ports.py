"""The port picker's pure parts: the kernel's ephemeral range read from /proc, and the range
drawn from (below it, or above it). That the ports it hands out bind and never repeat is
tests/integration/service/test_svc_ports.py (it binds sockets)."""

from __future__ import annotations

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
