"""The manifest's values: plain frozen dataclasses, constants and the limits' numbers (pure)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

FORMAT_VERSION = 1
#: Nesting a manifest may have: the API's 64 levels for a job spec, plus the run record around it.
MAX_DEPTH = 128
MAX_NDIM = 64
#: The largest block a reader hashes at once (elastrain writes 256 KiB blocks).
MAX_BLOCK_SIZE = 64 << 20
#: A manifest may be this large whatever its shards: per-tensor entries, optimizer extras, the
#: RNG states of thousands of ranks and the run record fit many times over.
MANIFEST_BASE_BYTES = 64 << 20
MANIFEST_NAME = "manifest.json"
Kind = Literal["replicated", "sharded", "per_rank"]
KINDS: tuple[str, ...] = ("replicated", "sharded", "per_rank")

#: Bytes per element of every dtype a checkpoint may hold (torch names).
ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


class Shaped:
    """``rows``, ``row_bytes`` and ``nbytes`` of anything with a ``dtype`` and a ``shape`` (a
    manifest entry, a save plan's tensor info): the one definition of a tensor's rows."""

    __slots__ = ()
    dtype: str
    shape: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_bytes(self) -> int:
        return row_bytes(self.dtype, self.shape)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows ``[start, stop)`` of one tensor, stored at ``offset`` in ``file``."""

    file: str
    offset: int
    nbytes: int
    rows: tuple[int, int]
    digests: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class TensorEntry(Shaped):
    """One tensor of a checkpoint. In a rank's report (:class:`worker.checkpoint.commit.Report`)
    the tensor table has no pieces; the manifest's entries list every piece."""

    dtype: str
    shape: tuple[int, ...]
    kind: Kind
    pieces: tuple[Piece, ...] = ()
    owner: int | None = None  # only for kind == "per_rank"


@dataclass(frozen=True, slots=True)
class FileEntry:
    size: int
    digest: str


@dataclass(frozen=True, slots=True)
class Manifest:
    """Everything a loader needs; see the module docstring for the layout rules."""

    job: str
    step: int
    generation: int
    world_size: int
    parallelism: str
    block_size: int
    tensors: dict[str, TensorEntry]
    files: dict[str, FileEntry]
    meta: dict[str, Any] = field(default_factory=dict)
    rank_meta: dict[str, dict[str, Any]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    run_record: dict[str, Any] = field(default_factory=dict)
    parent_step: int | None = None
    spec_hash: str = ""
    data_version: str = ""
    format_version: int = FORMAT_VERSION
    aliases: dict[str, str] = field(default_factory=dict)  # name -> stored tensor it is

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def row_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes in one dim-0 row (the whole tensor for a 0-d one)."""
    return ITEMSIZE[dtype] * math.prod(shape[1:] if shape else ())


def block_count(nbytes: int, block_size: int) -> int:
    return -(-nbytes // block_size)


def manifest_cap(shard_bytes: int) -> int:
    """The largest manifest a reader accepts next to ``shard_bytes`` bytes of files on disk.

    Each block of a piece costs about 35 bytes of manifest (its digest in a list), so 1/64 of
    the shard bytes covers blocks down to 4 KiB (elastrain writes 256 KiB: 64x to spare), and
    :data:`MANIFEST_BASE_BYTES` covers what does not grow with the bytes. A crafted manifest can
    make a reader hold at most that much, a bound set by the files really there.
    """
    return MANIFEST_BASE_BYTES + shard_bytes // 64
