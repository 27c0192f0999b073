"""Offline tools on published checkpoints, torch-free: reshard (weights-only export: :mod:`.export`).

``reshard`` rewrites a checkpoint for another world size by moving bytes: each new rank's file
gets the rows the new world's save plan gives it (replicated tensors rebalanced by bytes,
sharded tensors in FSDP2's ``torch.chunk`` layout, per-rank tensors of ranks that no longer
exist dropped). Every byte read is verified; memory stays bounded (rows move in chunks of at most
~64 MiB). The result is published like any save (staging, manifest, rename, ``latest``), and its
logical digest equals the source's.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from worker.checkpoint.blocks import BlockHasher, file_digest
from worker.checkpoint.commit import Expected, Report, build_manifest, decide
from worker.checkpoint.layout import (
    fsync_dir,
    load_manifest,
    resolve_checkpoint,
    shard_file_name,
    staging_dir_name,
    step_dir_name,
)
from worker.checkpoint.loadplan import Need, plan_reads
from worker.checkpoint.manifest import FileEntry, Manifest, Piece
from worker.checkpoint.owner import read_owner
from worker.checkpoint.publish import publish_staged
from worker.checkpoint.saveplan import TensorInfo, fsdp_rows, plan_rank
from worker.checkpoint.shardio import ShardReader
from worker.checkpoint.verify import CHUNK_BYTES as _CHUNK
from worker.checkpoint.verify import meta_digest
from worker.errors import CheckpointError


def _infos(m: Manifest, rank: int, world_size: int) -> list[TensorInfo]:
    out = []
    for name, t in m.tensors.items():
        if t.kind == "sharded":
            out.append(
                TensorInfo(
                    name, t.dtype, t.shape, "sharded", fsdp_rows(t.rows, rank=rank, world_size=world_size)
                )
            )
        elif t.kind == "per_rank":
            if t.owner is not None and t.owner < world_size:
                out.append(TensorInfo(name, t.dtype, t.shape, "per_rank", owner=t.owner))
        else:
            out.append(TensorInfo(name, t.dtype, t.shape))
    return out


def _copy_rows(reader: ShardReader, fd: int, name: str, lo: int, hi: int, hasher: BlockHasher) -> int:
    m = reader.manifest
    rb = m.tensors[name].row_bytes
    if rb == 0:
        return 0
    per = max(1, _CHUNK // rb)
    buf = bytearray()
    written = 0
    for start in range(lo, hi, per):
        stop = min(hi, start + per)
        n = (stop - start) * rb
        if len(buf) < n:
            buf = bytearray(n)
        view = memoryview(buf)[:n]
        reader.run(plan_reads(m, [Need(name, start, stop)]), {(name, start): view})
        hasher.update(view)
        pos = 0
        while pos < n:
            pos += os.write(fd, view[pos:])
        written += n
    return written


def _write_rank(reader: ShardReader, staging: Path, rank: int, world_size: int, block_size: int) -> Report:
    m = reader.manifest
    fname = shard_file_name(rank)
    pieces, blocks, offset = [], [], 0
    fd = os.open(staging / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for a in plan_rank(_infos(m, rank, world_size), rank=rank, world_size=world_size):
            hasher = BlockHasher(block_size)
            n = _copy_rows(reader, fd, a.name, a.start, a.stop, hasher)
            digests = hasher.finish()
            pieces.append((a.name, Piece(fname, offset, n, (a.start, a.stop), tuple(digests))))
            blocks += digests
            offset += n
        os.fsync(fd)
    finally:
        os.close(fd)
    headers = {
        n: dataclasses.replace(t, pieces=())
        for n, t in m.tensors.items()
        if t.kind != "per_rank" or (t.owner is not None and t.owner < world_size)
    }
    return Report(
        m.step, m.generation, rank, world_size, ok=True,
        files={fname: FileEntry(offset, file_digest(offset, blocks))}, pieces=tuple(pieces), tensors=headers,
        meta_digest=meta_digest(m.meta), rank_meta=m.rank_meta.get(str(rank), {}),
    )  # fmt: skip


def reshard(src: str | Path, dst: str | Path, *, world_size: int, block_size: int | None = None) -> Path:
    """Write ``src`` (step or job directory) re-laid-out for ``world_size`` ranks as a published
    step in job directory ``dst``. Returns the new step directory."""
    if world_size < 1:
        raise CheckpointError(f"--world-size must be at least 1, not {world_size}")
    step_dir = resolve_checkpoint(src)
    m = load_manifest(step_dir)
    dst_dir = Path(dst)
    owner = read_owner(dst_dir)
    if owner is not None:
        raise CheckpointError(
            f"{dst_dir} belongs to job {owner.job!r}; reshard into a new directory (the job that uses it "
            "claims it then)"
        )
    if (dst_dir / step_dir_name(m.step)).exists():
        raise CheckpointError(f"{dst_dir} already has {step_dir_name(m.step)}; choose an empty destination")
    dst_dir.mkdir(parents=True, exist_ok=True)
    staging = dst_dir / staging_dir_name(m.step, m.generation)
    staging.mkdir()
    bs = block_size or m.block_size
    with ShardReader(step_dir, m) as reader:
        reports = [_write_rank(reader, staging, r, world_size, bs) for r in range(world_size)]
    fsync_dir(staging)
    record = dict(m.run_record)
    record["resharded"] = {
        "source": str(step_dir),
        "from_world_size": m.world_size,
        "to_world_size": world_size,
        "note": f"ranks >= {m.world_size} have no saved RNG; it is derived from (seed, step, rank) at load",
    }
    ctx = {
        "job": m.job, "parallelism": m.parallelism, "block_size": bs, "meta": m.meta, "metrics": m.metrics,
        "run_record": record, "parent_step": m.parent_step, "spec_hash": m.spec_hash,
        "data_version": m.data_version, "aliases": m.aliases,
    }  # fmt: skip
    reports[0] = dataclasses.replace(reports[0], context=ctx)
    expected = Expected(m.step, m.generation, world_size)
    decision = decide(expected, reports, deadline_passed=True)
    if decision.action != "publish":
        raise CheckpointError(f"reshard produced an inconsistent layout: {decision.reason}")
    return publish_staged(dst_dir, staging, build_manifest(expected, reports))
