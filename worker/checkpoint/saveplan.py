"""The save plan: which rows of which tensors each rank writes (pure, torch-free).

* ``replicated`` tensors (every rank holds the same values: DDP parameters, optimizer state,
  scalars) are written once in total, spread over the ranks by bytes: the replicated tensors,
  in name order, form one virtual byte stream that is cut into ``world_size`` nearly equal
  ranges at row boundaries. A tensor is split along dim 0 only where a cut falls, so there are
  at most ``world_size - 1`` splits and every rank's share is within one row of ``total / W``.
* ``sharded`` tensors (FSDP2 ``Shard(0)`` DTensors) are written by their owners: each rank writes
  the rows it holds.
* ``per_rank`` tensors are written by their owner.

Every rank computes the same plan from the same tensor table, so no communication is needed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.checkpoint.manifest import ITEMSIZE, Shaped


@dataclass(frozen=True, slots=True)
class TensorInfo(Shaped):
    """What the planner needs to know about one tensor on this rank.

    ``local_rows`` is the global row range this rank holds for a ``sharded`` tensor (None for the
    other kinds); ``owner`` is the writing rank of a ``per_rank`` tensor.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    kind: str = "replicated"
    local_rows: tuple[int, int] | None = None
    owner: int | None = None


@dataclass(frozen=True, slots=True)
class Assignment:
    """Rows ``[start, stop)`` of tensor ``name`` that a rank writes."""

    name: str
    start: int
    stop: int


def split_replicated(tensors: Sequence[TensorInfo], world_size: int) -> list[list[Assignment]]:
    """Cut the replicated byte stream into ``world_size`` shares at row boundaries.

    Rank ``k`` gets the rows whose first byte lies in ``[k*T/W, (k+1)*T/W)``; empty tensors and
    empty shares produce no assignment.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    ordered = sorted((t for t in tensors if t.rows and t.row_bytes), key=lambda t: t.name)
    total = sum(t.rows * t.row_bytes for t in ordered)
    shares: list[list[Assignment]] = [[] for _ in range(world_size)]
    base = 0
    for t in ordered:
        rb = t.row_bytes
        for k in range(world_size):
            lo = _rows_before(k * total, world_size, base, rb, t.rows)
            hi = _rows_before((k + 1) * total, world_size, base, rb, t.rows)
            if hi > lo:
                shares[k].append(Assignment(t.name, lo, hi))
        base += t.rows * rb
    return shares


def _rows_before(scaled_bound: int, world_size: int, base: int, rb: int, rows: int) -> int:
    """How many rows of a tensor starting at byte ``base`` begin before ``scaled_bound / W``."""
    # Row i starts at base + i*rb; count i with (base + i*rb) * W < scaled_bound (integers only).
    need = scaled_bound - base * world_size
    if need <= 0:
        return 0
    step = rb * world_size
    return min(rows, -(-need // step))


def plan_rank(tensors: Sequence[TensorInfo], *, rank: int, world_size: int) -> list[Assignment]:
    """The rows ``rank`` writes, in name order. Every rank must pass the same tensor table
    (local_rows aside)."""
    for t in tensors:
        if t.dtype not in ITEMSIZE:
            raise ValueError(f"tensor {t.name}: dtype {t.dtype!r} cannot be checkpointed")
    replicated = [t for t in tensors if t.kind == "replicated"]
    out = list(split_replicated(replicated, world_size)[rank])
    for t in tensors:
        if t.kind == "sharded":
            if t.local_rows is None:
                raise ValueError(f"sharded tensor {t.name} needs local_rows")
            lo, hi = t.local_rows
            if hi > lo and t.row_bytes:
                out.append(Assignment(t.name, lo, hi))
        elif t.kind == "per_rank" and t.owner == rank and t.rows and t.row_bytes:
            out.append(Assignment(t.name, 0, t.rows))
        elif t.kind not in ("replicated", "sharded", "per_rank"):
            raise ValueError(f"tensor {t.name}: unknown kind {t.kind!r}")
    out.sort(key=lambda a: (a.name, a.start))
    return out


def fsdp_rows(rows: int, *, rank: int, world_size: int) -> tuple[int, int]:
    """The rows FSDP2 gives ``rank`` of a dim-0 sharded tensor (``torch.chunk`` semantics)."""
    chunk = -(-rows // world_size) if rows else 0
    lo = min(rows, rank * chunk)
    return lo, min(rows, lo + chunk)
