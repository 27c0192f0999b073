"""The etcd-v3 c10d store follows TCPStore's rules for add and compare_set (pure decisions)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from service.rendezvous.store import add_value, compare_set_outcome


def test_add_starts_at_zero_and_stores_decimal_text() -> None:
    assert add_value(None, 1) == (b"1", 1)
    assert add_value(b"41", 1) == (b"42", 42)
    assert add_value(b"5", -7) == (b"-2", -2)


def test_add_on_a_non_number_is_a_store_error() -> None:
    with pytest.raises(dist.DistStoreError, match="not a number"):
        add_value(b"abc", 1)


@pytest.mark.parametrize(
    ("current", "expected", "desired", "outcome"),
    [
        (None, b"", b"new", (True, b"new")),  # absent + expected empty: create
        (None, b"x", b"new", (False, b"x")),  # absent + expected given: TCPStore returns expected
        (b"x", b"x", b"new", (True, b"new")),  # match: swap
        (b"y", b"x", b"new", (False, b"y")),  # mismatch: current value
        (b"", b"", b"new", (True, b"new")),  # present but empty matches empty
    ],
)
def test_compare_set_matches_tcpstore(
    current: bytes | None, expected: bytes, desired: bytes, outcome: tuple[bool, bytes]
) -> None:
    assert compare_set_outcome(current, expected, desired) == outcome
