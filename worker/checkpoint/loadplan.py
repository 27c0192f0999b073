"""The load plan: which byte ranges of which files a rank reads for the rows it needs (pure).

Resharding is nothing more than this: a rank at any world size asks for the rows it holds now,
and the plan maps them onto the pieces the old world wrote. Reads are widened to whole blocks of
the piece so every byte that is used is verified against its block digest. Adjacent small reads
in one file are merged (up to ``max_read`` bytes) to keep syscalls few; a read of at least
``small`` bytes stays alone so that it can land directly in the tensor's memory without a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.checkpoint.manifest import Manifest, Piece
from worker.checkpoint.saveplan import fsdp_rows
from worker.errors import CheckpointError

DEFAULT_MAX_READ = 16 << 20
DEFAULT_SMALL = 1 << 20


@dataclass(frozen=True, slots=True)
class Need:
    """Rows ``[start, stop)`` of tensor ``name`` that this rank wants."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class BlockCheck:
    """Bytes ``[offset, offset + nbytes)`` of the read buffer must hash to ``digest``."""

    offset: int
    nbytes: int
    digest: str


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy ``nbytes`` from ``src`` in the read buffer to byte ``dst`` of the need's buffer."""

    name: str
    need_start: int
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Read ``nbytes`` at ``offset`` of ``file``, verify ``checks``, then apply ``copies``."""

    file: str
    offset: int
    nbytes: int
    checks: tuple[BlockCheck, ...]
    copies: tuple[Copy, ...]


def plan_reads(
    manifest: Manifest, needs: Sequence[Need], *, max_read: int = DEFAULT_MAX_READ, small: int = DEFAULT_SMALL
) -> list[ReadOp]:
    """Read ops covering every need; raises :class:`CheckpointError` if a need is not in the
    checkpoint (unknown tensor, or rows beyond its shape)."""
    ops: list[ReadOp] = []
    for need in needs:
        entry = manifest.tensors.get(need.name)
        if entry is None:
            raise CheckpointError(f"tensor {need.name!r} is not in the checkpoint of step {manifest.step}")
        if not 0 <= need.start <= need.stop <= entry.rows:
            raise CheckpointError(
                f"tensor {need.name!r}: rows [{need.start}, {need.stop}) are outside its {entry.rows} rows"
            )
        rb = entry.row_bytes
        if need.stop == need.start or rb == 0:
            continue
        covered = 0
        for piece in sorted(entry.pieces, key=lambda p: p.rows):
            lo, hi = max(need.start, piece.rows[0]), min(need.stop, piece.rows[1])
            if hi > lo:
                ops.append(_op_for(piece, need, lo, hi, rb, manifest.block_size))
                covered += hi - lo
        if covered != need.stop - need.start:
            raise CheckpointError(
                f"tensor {need.name!r}: the checkpoint's pieces do not cover the rows needed"
            )
    return merge_reads(ops, max_read=max_read, small=small)


def _op_for(piece: Piece, need: Need, lo: int, hi: int, rb: int, block: int) -> ReadOp:
    first = (lo - piece.rows[0]) * rb  # byte range inside the piece
    last = (hi - piece.rows[0]) * rb
    b0, b1 = first // block, -(-last // block)
    start = b0 * block
    end = min(piece.nbytes, b1 * block)
    checks = tuple(
        BlockCheck(
            offset=i * block - start, nbytes=min(block, piece.nbytes - i * block), digest=piece.digests[i]
        )
        for i in range(b0, b1)
    )
    copy = Copy(
        name=need.name,
        need_start=need.start,
        src=first - start,
        dst=(lo - need.start) * rb,
        nbytes=last - first,
    )
    return ReadOp(
        file=piece.file, offset=piece.offset + start, nbytes=end - start, checks=checks, copies=(copy,)
    )


def merge_reads(
    ops: Sequence[ReadOp], *, max_read: int = DEFAULT_MAX_READ, small: int = DEFAULT_SMALL
) -> list[ReadOp]:
    """Merge small reads that are adjacent in one file (sorted by file, offset); overlapping
    reads (two needs in one block) are kept apart."""
    out: list[ReadOp] = []
    for op in sorted(ops, key=lambda o: (o.file, o.offset)):
        prev = out[-1] if out else None
        if (
            prev is not None
            and prev.file == op.file
            and prev.offset + prev.nbytes == op.offset
            and op.nbytes < small
            and (prev.nbytes < small or len(prev.copies) > 1)
            and prev.nbytes + op.nbytes <= max_read
        ):
            shift = prev.nbytes
            out[-1] = ReadOp(
                file=prev.file,
                offset=prev.offset,
                nbytes=prev.nbytes + op.nbytes,
                checks=prev.checks
                + tuple(BlockCheck(c.offset + shift, c.nbytes, c.digest) for c in op.checks),
                copies=prev.copies
                + tuple(Copy(c.name, c.need_start, c.src + shift, c.dst, c.nbytes) for c in op.copies),
            )
        else:
            out.append(op)
    return out


def bytes_read(ops: Sequence[ReadOp]) -> int:
    return sum(op.nbytes for op in ops)


def needs_for_rank(
    manifest: Manifest, *, rank: int, world_size: int, names: Sequence[str] | None = None
) -> list[Need]:
    """What a rank of a ``world_size`` world holds of each tensor under the manifest's
    parallelism: everything for replicated tensors, its FSDP rows for sharded ones, its own
    per_rank tensors. (The live trainer derives needs from its model instead; this serves the
    offline tools and tests.)"""
    out = []
    for name in sorted(names if names is not None else manifest.tensors):
        entry = manifest.tensors[name]
        if entry.kind == "sharded":
            lo, hi = fsdp_rows(entry.rows, rank=rank, world_size=world_size)
        elif entry.kind == "per_rank":
            if entry.owner != rank:
                continue
            lo, hi = 0, entry.rows
        else:
            lo, hi = 0, entry.rows
        out.append(Need(name, lo, hi))
    return out
