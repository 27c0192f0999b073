"""The layout rules a manifest must follow (:func:`validate`) and the writer's side of the
limits (:func:`check_readable`); pure."""

from __future__ import annotations

import re

from worker.checkpoint.manifest.model import (
    FORMAT_VERSION,
    ITEMSIZE,
    KINDS,
    MANIFEST_NAME,
    MAX_BLOCK_SIZE,
    MAX_DEPTH,
    Manifest,
    TensorEntry,
    block_count,
    manifest_cap,
)
from worker.errors import CheckpointError, CorruptCheckpointError
from worker.jobspec.jsonlimits import json_depth

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_readable(text: str, shard_bytes: int) -> None:
    """Refuse (:class:`CheckpointError`) to publish a manifest a reader would refuse."""
    depth = json_depth(text)
    if depth > MAX_DEPTH:
        raise CheckpointError(
            f"the manifest would be nested {depth} levels deep and readers refuse more than {MAX_DEPTH}: "
            "keep progress, metrics and the run record shallower"
        )
    size, cap = len(text.encode()), manifest_cap(shard_bytes)
    if size > cap:
        raise CheckpointError(f"the manifest would be {size} bytes and readers refuse more than {cap}")


def validate(m: Manifest) -> None:
    """Refuse a manifest that breaks any layout rule. Raises :class:`CorruptCheckpointError`."""
    problems = list(_problems(m))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptCheckpointError(f"invalid manifest for step {m.step}: {problems[0]}{more}")


def _problems(m: Manifest) -> list[str]:
    out: list[str] = []
    if m.format_version != FORMAT_VERSION:
        out.append(f"format_version {m.format_version} is not {FORMAT_VERSION}; upgrade elastrain to read it")
    if m.step < 0 or m.generation < 0 or m.world_size < 1:
        out.append("step and generation must be >= 0 and world_size >= 1")
    if not 1 <= m.block_size <= MAX_BLOCK_SIZE:
        out.append(f"block_size {m.block_size} is over the limit of {MAX_BLOCK_SIZE} or not positive")
        return out
    for fname, f in m.files.items():
        if not _FILE_RE.match(fname) or fname == MANIFEST_NAME:
            out.append(f"file name {fname!r} is not allowed (plain names only, no paths)")
        if f.size < 0 or not _HEX32.match(f.digest):
            out.append(f"file {fname}: bad size or digest")
    for alias, target in m.aliases.items():
        if alias in m.tensors or not alias:
            out.append(
                f"alias {alias!r} is a stored tensor; an alias names a tensor stored under another name"
            )
        elif target not in m.tensors or m.tensors[target].kind == "per_rank":
            out.append(f"alias {alias!r} -> {target!r}: the target is not a stored tensor")
    by_file: dict[str, list[tuple[int, int, str]]] = {n: [] for n in m.files}
    for name, t in m.tensors.items():
        out.extend(_tensor_problems(name, t, m, by_file))
    for fname, spans in by_file.items():
        pos = 0
        for start, nbytes, name in sorted(spans):
            if start != pos:
                out.append(f"file {fname}: bytes [{pos}, {start}) are not covered (at piece of {name})")
            pos = max(pos, start + nbytes)
        if pos != m.files[fname].size:
            out.append(f"file {fname}: pieces cover {pos} bytes but the file has {m.files[fname].size}")
    return out


def _tensor_problems(
    name: str, t: TensorEntry, m: Manifest, by_file: dict[str, list[tuple[int, int, str]]]
) -> list[str]:
    if not name:
        return ["empty tensor name"]
    if t.dtype not in ITEMSIZE:
        return [f"tensor {name}: unknown dtype {t.dtype!r}"]
    if t.kind not in KINDS:
        return [f"tensor {name}: unknown kind {t.kind!r}"]
    if any(s < 0 for s in t.shape):
        return [f"tensor {name}: negative dimension in {t.shape}"]
    if (t.kind == "per_rank") != (t.owner is not None):
        return [f"tensor {name}: 'owner' is required for per_rank tensors and only for them"]
    out = []
    rb, covered = t.row_bytes, 0
    for p in sorted(t.pieces, key=lambda p: p.rows):
        start, stop = p.rows
        if start != covered or stop <= start:
            out.append(f"tensor {name}: rows [{covered}, {start}) missing or pieces overlap")
        covered = max(covered, stop)
        if p.nbytes != (stop - start) * rb:
            out.append(f"tensor {name}: piece rows [{start}, {stop}) should be {(stop - start) * rb} bytes")
        if len(p.digests) != block_count(p.nbytes, m.block_size) or not all(
            _HEX32.match(d) for d in p.digests
        ):
            out.append(f"tensor {name}: piece rows [{start}, {stop}) has wrong block digests")
        if p.file not in by_file:
            out.append(f"tensor {name}: piece in unknown file {p.file!r}")
        elif p.offset < 0:
            out.append(f"tensor {name}: negative offset")
        else:
            by_file[p.file].append((p.offset, p.nbytes, name))
    if covered != t.rows:
        out.append(f"tensor {name}: pieces cover rows [0, {covered}) of {t.rows}")
    return out
