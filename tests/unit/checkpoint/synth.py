"""A synthetic checkpoint held in memory: files as bytes, built through the real save plan,
block digests and commit path (no torch, no disk)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from worker.checkpoint.blocks import block_digests, file_digest
from worker.checkpoint.commit import Expected, Report, build_manifest
from worker.checkpoint.layout import staging_dir_name
from worker.checkpoint.manifest import FileEntry, Manifest, Piece, TensorEntry, row_bytes
from worker.checkpoint.publish import publish_staged
from worker.checkpoint.saveplan import TensorInfo, fsdp_rows, plan_rank


@dataclass
class Synth:
    manifest: Manifest
    files: dict[str, bytes]
    logical: dict[str, bytes]


def logical_bytes(name: str, dtype: str, shape: tuple[int, ...]) -> bytes:
    rows = shape[0] if shape else 1
    n = rows * row_bytes(dtype, shape)
    seed = sum(name.encode()) % 251
    return bytes((seed + i * 7) % 256 for i in range(n))


def infos_for(
    tensors: dict[str, tuple[str, tuple[int, ...], str]], rank: int, world: int
) -> list[TensorInfo]:
    out = []
    for name, (dtype, shape, kind) in tensors.items():
        rows = shape[0] if shape else 1
        if kind == "sharded":
            out.append(TensorInfo(name, dtype, shape, kind, fsdp_rows(rows, rank=rank, world_size=world)))
        elif kind == "per_rank":
            out.append(TensorInfo(name, dtype, shape, kind, owner=int(name.split("/")[0][4:])))
        else:
            out.append(TensorInfo(name, dtype, shape, kind))
    return out


def reports_for(
    tensors: dict[str, tuple[str, tuple[int, ...], str]], world: int, *, block_size: int, step: int = 10
) -> tuple[list[Report], dict[str, bytes], dict[str, bytes]]:
    logical = {n: logical_bytes(n, d, s) for n, (d, s, _) in tensors.items()}
    headers = {
        n: TensorEntry(d, s, k, owner=int(n.split("/")[0][4:]) if k == "per_rank" else None)  # type: ignore[arg-type]
        for n, (d, s, k) in tensors.items()
    }
    reports, files = [], {}
    for rank in range(world):
        fname = f"rank-{rank:05d}.bin"
        data, pieces, blocks = bytearray(), [], []
        for a in plan_rank(infos_for(tensors, rank, world), rank=rank, world_size=world):
            dtype, shape, _ = tensors[a.name]
            rb = row_bytes(dtype, shape)
            chunk = logical[a.name][a.start * rb : a.stop * rb]
            digests = block_digests(chunk, block_size)
            pieces.append((a.name, Piece(fname, len(data), len(chunk), (a.start, a.stop), tuple(digests))))
            blocks += digests
            data += chunk
        files[fname] = bytes(data)
        reports.append(
            Report(
                step,
                0,
                rank,
                world,
                ok=True,
                files={fname: FileEntry(len(data), file_digest(len(data), blocks))},
                pieces=tuple(pieces),
                tensors=headers,
                meta_digest="m",
                rank_meta={"rng": rank},
                context={
                    "job": "j",
                    "parallelism": "ddp",
                    "block_size": block_size,
                    "meta": {"progress": {}},
                },
            )
        )
    return reports, files, logical


def synth(
    tensors: dict[str, tuple[str, tuple[int, ...], str]], world: int, *, block_size: int = 16, step: int = 10
) -> Synth:
    reports, files, logical = reports_for(tensors, world, block_size=block_size, step=step)
    manifest = build_manifest(Expected(step, 0, world), reports)
    return Synth(manifest, files, logical)


TENSORS: dict[str, tuple[str, tuple[int, ...], str]] = {
    "model.a.weight": ("float32", (7, 5), "replicated"),
    "model.a.bias": ("float32", (7,), "replicated"),
    "model.b.weight": ("bfloat16", (3, 7), "replicated"),
    "model.big": ("float32", (40, 3), "replicated"),
    "model.empty": ("float32", (0, 4), "replicated"),
    "optim.state.a.weight.step": ("float32", (), "replicated"),
    "optim.state.a.weight.exp_avg": ("float32", (7, 5), "sharded"),
    "optim.state.a.bias.exp_avg": ("float64", (3,), "sharded"),
    "rank1/extra": ("int64", (2,), "per_rank"),
}


def write_published(job_dir: Path, s: Synth) -> Path:
    """Put a synthetic checkpoint on disk through the real publish path."""
    staging = job_dir / staging_dir_name(s.manifest.step, s.manifest.generation)
    staging.mkdir(parents=True)
    for name, data in s.files.items():
        (staging / name).write_bytes(data)
    return publish_staged(job_dir, staging, s.manifest)
