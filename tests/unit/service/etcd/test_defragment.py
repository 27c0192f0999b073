"""When the embedded etcd is defragmented at start: a large file, at least half of it free."""

from __future__ import annotations

from typing import Any

from service.etcd.server import DEFRAGMENT_FROM_BYTES, defragment_if_sparse, wants_defragment

BIG = DEFRAGMENT_FROM_BYTES


def test_only_a_large_file_mostly_free_is_defragmented() -> None:
    assert wants_defragment(BIG, BIG // 2)
    assert wants_defragment(4 * BIG, BIG)
    assert not wants_defragment(BIG, BIG // 2 + 1)  # more than half in use
    assert not wants_defragment(BIG - 1, 0)  # small: not worth blocking etcd for


class Member:
    """etcd's maintenance answers as the gateway sends them (64-bit numbers as strings)."""

    def __init__(self, size: int, in_use: int) -> None:
        self.size, self.in_use, self.calls = size, in_use, []  # type: ignore[var-annotated]

    def post(self, path: str, body: dict[str, Any], *, replay_safe: bool = True) -> dict[str, Any]:
        self.calls.append(path)
        if path == "maintenance/defragment":
            self.size = self.in_use
            return {}
        return {"dbSize": str(self.size), "dbSizeInUse": str(self.in_use)}


def test_a_sparse_member_is_defragmented_and_the_sizes_said() -> None:
    member = Member(4 * BIG, BIG)
    assert defragment_if_sparse(member) == (4 * BIG, BIG)  # type: ignore[arg-type]
    assert member.calls == ["maintenance/status", "maintenance/defragment", "maintenance/status"]


def test_a_dense_member_is_left_alone() -> None:
    member = Member(4 * BIG, 3 * BIG)
    assert defragment_if_sparse(member) is None  # type: ignore[arg-type]
    assert member.calls == ["maintenance/status"]
