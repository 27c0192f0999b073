from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.checkpoint.saveplan import TensorInfo, fsdp_rows, plan_rank, split_replicated


def _coverage(tensors: list[TensorInfo], world: int) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {}
    for rank in range(world):
        for a in plan_rank(tensors, rank=rank, world_size=world):
            out.setdefault(a.name, []).append((a.start, a.stop))
    return {n: sorted(r) for n, r in out.items()}


shapes = st.lists(
    st.tuples(st.integers(0, 50), st.integers(1, 9), st.sampled_from(["float32", "bfloat16", "int64"])),
    min_size=0,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes, world=st.integers(1, 9))
def test_replicated_rows_written_exactly_once_and_balanced(shapes, world) -> None:  # type: ignore[no-untyped-def]
    tensors = [TensorInfo(f"t{i:02d}", dtype, (rows, cols)) for i, (rows, cols, dtype) in enumerate(shapes)]
    coverage = _coverage(tensors, world)
    for t in tensors:
        spans = coverage.get(t.name, [])
        pos = 0
        for start, stop in spans:
            assert start == pos and stop > start
            pos = stop
        assert pos == t.rows
    shares = split_replicated(tensors, world)
    loads = [
        sum((a.stop - a.start) * next(t for t in tensors if t.name == a.name).row_bytes for a in s)
        for s in shares
    ]
    total = sum(t.rows * t.row_bytes for t in tensors)
    widest = max((t.row_bytes for t in tensors), default=0)
    for load in loads:
        assert abs(load - total / world) <= widest


def test_balance_splits_a_big_tensor_along_dim0() -> None:
    tensors = [TensorInfo("big", "float32", (1000, 256)), TensorInfo("small", "float32", (10,))]
    shares = split_replicated(tensors, 4)
    assert [len(s) for s in shares] == [1, 1, 1, 2]
    assert [(a.start, a.stop) for a in shares[0]] == [(0, 251)]  # ~ (1000*1024 + 40) / 4 bytes each


def test_scalars_are_one_row() -> None:
    tensors = [TensorInfo(f"s{i}", "float32", ()) for i in range(4)]
    assert [[a.name for a in s] for s in split_replicated(tensors, 2)] == [["s0", "s1"], ["s2", "s3"]]


def test_sharded_written_by_owner_and_per_rank_by_its_owner() -> None:
    tensors = [
        TensorInfo("w", "float32", (7, 3), "sharded", local_rows=(3, 6)),
        TensorInfo("empty_shard", "float32", (3, 3), "sharded", local_rows=(3, 3)),
        TensorInfo("mine", "int64", (2,), "per_rank", owner=1),
    ]
    assert [(a.name, a.start, a.stop) for a in plan_rank(tensors, rank=1, world_size=3)] == [
        ("mine", 0, 2),
        ("w", 3, 6),
    ]
    assert [a.name for a in plan_rank(tensors, rank=0, world_size=3)] == ["w"]


def test_sharded_without_local_rows_is_an_error() -> None:
    with pytest.raises(ValueError, match="local_rows"):
        plan_rank([TensorInfo("w", "float32", (4,), "sharded")], rank=0, world_size=2)


@pytest.mark.parametrize(
    ("rows", "world", "expect"),
    [(7, 3, [(0, 3), (3, 6), (6, 7)]), (3, 4, [(0, 1), (1, 2), (2, 3), (3, 3)]), (0, 2, [(0, 0), (0, 0)])],
)
def test_fsdp_rows_match_torch_chunk(rows: int, world: int, expect: list[tuple[int, int]]) -> None:
    assert [fsdp_rows(rows, rank=r, world_size=world) for r in range(world)] == expect
