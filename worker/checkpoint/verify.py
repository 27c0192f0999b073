"""Torch-free readers of a published step: full verification and the logical digest.

The logical digest (``elastrain checkpoint digest``) is xxh3-128 over, in this order:

1. for every stored tensor except ``per_rank`` ones, in name order: the JSON header
   ``[name, dtype, shape]`` and then its logical bytes (rows 0..N-1 in C order, however they
   were split into pieces and files); a tied or shared tensor is stored, and counted, once;
   then, when the manifest has aliases, ``aliases`` and their sorted JSON pairs;
2. the canonical JSON (sorted keys, no spaces) of :func:`digest_meta` of the manifest's ``meta``:
   the trainer's progress without the keys that legitimately depend on the world size or the
   wall clock (:data:`EXCLUDED_PROGRESS_KEYS`, plus any listed in ``progress["digest_exclude"]``),
   and the non-tensor optimizer/model entries without ``lr``/``initial_lr`` (derived from the
   schedule and the LR scaling rule, which depend on the world size).

Not covered: world size, generation, parallelism, file layout, per-rank RNG (``rank_meta``),
metrics, run record, spec hash, data version, parent step. So the digest is equal for the same
logical state however it was sharded, and across an offline reshard.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import xxhash

from worker.checkpoint.blocks import file_digest
from worker.checkpoint.loadplan import Need, plan_reads
from worker.checkpoint.manifest import MANIFEST_NAME, Manifest, TensorEntry
from worker.checkpoint.places import Place, load_manifest, reader, resolve_checkpoint
from worker.checkpoint.remote import object_sizes
from worker.checkpoint.shardio import ShardReader
from worker.checkpoint.storage import storage_for
from worker.errors import CheckpointError
from worker.jobspec.location import S3Location

EXCLUDED_PROGRESS_KEYS = frozenset(
    {"batch_plan", "world_size", "topology", "wall_time", "elapsed_seconds", "spec_hash", "digest_exclude"}
)
_DERIVED_EXTRA = ("lr", "initial_lr")
CHUNK_BYTES = 64 << 20


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def meta_digest(meta: dict[str, Any]) -> str:
    """Digest of the whole global meta (what the ranks must agree on before publishing)."""
    return xxhash.xxh3_128_hexdigest(canonical_json(meta))


def digest_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """The part of ``meta`` the logical digest covers (see the module docstring)."""
    progress = dict(meta.get("progress", {}))
    drop = set(EXCLUDED_PROGRESS_KEYS) | set(progress.get("digest_exclude", []))
    extra = dict(meta.get("extra", {}))
    return {
        "progress": {k: v for k, v in progress.items() if k not in drop},
        "extra": {k: v for k, v in extra.items() if k.rsplit(".", 1)[-1] not in _DERIVED_EXTRA},
    }


def _row_chunks(entry: TensorEntry) -> Iterator[tuple[int, int]]:
    if entry.nbytes == 0:  # no bytes to read, however many (empty) rows the shape has
        return
    per = max(1, CHUNK_BYTES // entry.row_bytes)
    for lo in range(0, entry.rows, per):
        yield lo, min(entry.rows, lo + per)


def iter_tensor_bytes(reader: ShardReader, name: str) -> Iterator[memoryview]:
    """The logical bytes of one tensor, verified, in chunks of at most ~64 MiB."""
    m = reader.manifest
    entry = m.tensors[name]
    buf = bytearray()
    for lo, hi in _row_chunks(entry):
        n = (hi - lo) * entry.row_bytes
        if len(buf) < n:
            buf = bytearray(n)
        view = memoryview(buf)[:n]
        reader.run(plan_reads(m, [Need(name, lo, hi)]), {(name, lo): view})
        yield view


def logical_digest(path: str | Place) -> str:
    """The logical digest of a checkpoint (a step or job directory); verifies what it reads.

    Raises :class:`CorruptCheckpointError` naming the file and offset of a bad block."""
    step_dir = resolve_checkpoint(path)
    m = load_manifest(step_dir)
    h = xxhash.xxh3_128()
    h.update(b"elastrain-logical-v1\0")
    with reader(step_dir, m) as shards:
        for name in sorted(m.tensors):
            entry = m.tensors[name]
            if entry.kind == "per_rank":
                continue
            h.update(canonical_json([name, entry.dtype, list(entry.shape)]) + b"\0")
            for chunk in iter_tensor_bytes(shards, name):
                h.update(chunk)
    if m.aliases:  # only then, so the digest of a model without ties is what it always was
        h.update(b"aliases\0" + canonical_json(sorted(m.aliases.items())))
    h.update(b"meta\0" + canonical_json(digest_meta(m.meta)))
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    offset: int | None
    message: str

    def __str__(self) -> str:
        where = self.file if self.offset is None else f"{self.file} offset {self.offset}"
        return f"{where}: {self.message}"


def verify_checkpoint(path: str | Place, *, limit: int = 100) -> tuple[Place, list[Problem]]:
    """Check every block of every file, the file sizes and file digests. Returns the step
    directory and up to ``limit`` problems (empty: the checkpoint verifies)."""
    step_dir = resolve_checkpoint(path)
    try:
        m = load_manifest(step_dir, check_files=False)
    except CheckpointError as exc:
        return step_dir, [Problem(MANIFEST_NAME, None, str(exc))]
    problems: list[Problem] = []
    for fname in sorted(m.files):
        problems.extend(_verify_file(step_dir, m, fname))
        if len(problems) >= limit:
            break
    return step_dir, problems[:limit]


def _verify_file(step_dir: Place, m: Manifest, fname: str) -> list[Problem]:
    entry = m.files[fname]
    if isinstance(step_dir, S3Location):
        size: int | None = object_sizes(step_dir).get(fname)
    else:
        try:
            size = (step_dir / fname).stat().st_size
        except FileNotFoundError:
            size = None
    if size is None:
        return [Problem(fname, None, "shard file is missing")]
    if size != entry.size:
        return [
            Problem(fname, min(size, entry.size), f"file is {size} bytes, the manifest says {entry.size}")
        ]
    spans = sorted(
        (p.offset, p.nbytes, p.digests) for t in m.tensors.values() for p in t.pieces if p.file == fname
    )
    out: list[Problem] = []
    blocks: list[str] = []
    with _ranges(step_dir, fname) as read:
        for offset, nbytes, digests in spans:
            blocks.extend(digests)
            for i, want in enumerate(digests):
                start = offset + i * m.block_size
                data = read(start, min(m.block_size, nbytes - i * m.block_size))
                if xxhash.xxh3_128_hexdigest(data) != want:
                    out.append(Problem(fname, start, f"block digest mismatch ({len(data)} bytes)"))
    if file_digest(entry.size, blocks) != entry.digest:
        out.append(Problem(fname, None, "file digest does not match its block digests"))
    return out


@contextmanager
def _ranges(step_dir: Place, fname: str) -> Iterator[Callable[[int, int], bytes]]:
    """``read(offset, nbytes)`` on one shard: a file, or ranged reads of an object."""
    if isinstance(step_dir, S3Location):
        store, key = storage_for(step_dir), step_dir.key(fname)
        yield lambda start, n: store.read(key, start, start + n)
        return
    with open(step_dir / fname, "rb") as f:

        def read(start: int, n: int) -> bytes:
            f.seek(start)
            return f.read(n)

        yield read
