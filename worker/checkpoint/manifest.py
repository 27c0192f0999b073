"""The checkpoint manifest: what a published step directory holds, as plain dataclasses.

Torch-free and pure (the control plane imports it). ``manifest.json`` is plain JSON: nothing on
the load path unpickles or evaluates anything. :func:`manifest_from_json` refuses anything that
is not exactly the schema below, so a crafted manifest fails with :class:`CorruptCheckpointError`
instead of reaching the readers.

Layout rules the validator enforces:

* a tensor's logical bytes are its rows (dim-0 slices, C order) concatenated; a 0-d tensor has
  one row. A piece holds rows ``[start, stop)`` of one tensor at ``offset`` in one file;
* the pieces of a ``replicated`` or ``sharded`` tensor tile ``[0, rows)`` exactly; a
  ``per_rank`` tensor (state only its ``owner`` rank uses) has one piece with all rows;
* the pieces in a file tile ``[0, size)`` exactly, so every byte of every file is covered;
* ``digests[i]`` is the xxh3-128 hex digest of bytes ``[i*block_size, (i+1)*block_size)`` of the
  piece; a file's ``digest`` is :func:`worker.checkpoint.blocks.file_digest` of its blocks.

Limits (issue 13): the text is parsed by :func:`worker.jsonlimits.loads` (nested at most
:data:`MAX_DEPTH` levels: a run record holds a job spec, which the API admits 64 levels deep);
integers are below 2**63, a shape has at most :data:`MAX_NDIM` dimensions and ``block_size`` is at
most :data:`MAX_BLOCK_SIZE`, so no number here sizes a read or a buffer beyond that before the
files are checked. The size cap and the check against the files on disk belong to the reader
(:func:`worker.checkpoint.layout.load_manifest`); :func:`manifest_cap` is its rule, and a writer
never publishes a manifest that :func:`check_readable` says a reader would refuse.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from worker.errors import CheckpointError, CorruptCheckpointError
from worker.jsonlimits import JSONRefused, json_depth, loads

FORMAT_VERSION = 1
#: Nesting a manifest may have: the API's 64 levels for a job spec, plus the run record around it.
MAX_DEPTH = 128
MAX_NDIM = 64
#: The largest block a reader hashes at once (elastrain writes 256 KiB blocks).
MAX_BLOCK_SIZE = 64 << 20
_MAX_INT = 1 << 63
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
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


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

    Each block of a piece costs about 44 bytes of manifest (its digest on a line), so 1/64 of
    the shard bytes covers blocks down to 4 KiB (elastrain writes 256 KiB: 64x to spare), and
    :data:`MANIFEST_BASE_BYTES` covers what does not grow with the bytes. A crafted manifest can
    make a reader hold at most that much, a bound set by the files really there.
    """
    return MANIFEST_BASE_BYTES + shard_bytes // 64


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


# ---------------------------------------------------------------- serialisation


def manifest_to_dict(m: Manifest) -> dict[str, Any]:
    tensors = {}
    for name in sorted(m.tensors):
        t = m.tensors[name]
        entry: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "kind": t.kind}
        if t.owner is not None:
            entry["owner"] = t.owner
        entry["pieces"] = [
            {
                "file": p.file,
                "offset": p.offset,
                "nbytes": p.nbytes,
                "rows": list(p.rows),
                "digests": list(p.digests),
            }
            for p in t.pieces
        ]
        tensors[name] = entry
    return {
        "format_version": m.format_version,
        "job": m.job,
        "step": m.step,
        "generation": m.generation,
        "world_size": m.world_size,
        "parallelism": m.parallelism,
        "block_size": m.block_size,
        "parent_step": m.parent_step,
        "spec_hash": m.spec_hash,
        "data_version": m.data_version,
        "files": {n: {"size": f.size, "digest": f.digest} for n, f in sorted(m.files.items())},
        "tensors": tensors,
        "meta": m.meta,
        "rank_meta": m.rank_meta,
        "metrics": m.metrics,
        "run_record": m.run_record,
    }


def manifest_to_json(m: Manifest) -> str:
    """Deterministic JSON text (sorted files and tensors)."""
    return json.dumps(manifest_to_dict(m), indent=1, sort_keys=False) + "\n"


def manifest_from_json(
    text: str | bytes, *, what: str = "manifest", max_bytes: int | None = None
) -> Manifest:
    """Parse (depth-capped), check the schema, validate. Raises :class:`CorruptCheckpointError`
    naming ``what`` (e.g. the file) and the first problem, in one line. ``max_bytes``: refuse a
    longer text (None: the caller that read the bytes has bounded them; see
    :func:`worker.checkpoint.layout.load_manifest`)."""
    limit = max_bytes if max_bytes is not None else len(text)
    try:
        raw = loads(text, max_bytes=limit, max_depth=MAX_DEPTH, what=what)
    except JSONRefused as exc:
        raise CorruptCheckpointError(str(exc)) from None
    try:
        m = _from_dict(raw)
    except KeyError as exc:
        raise CorruptCheckpointError(f"{what} does not follow the schema: field {exc} is missing") from None
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{what} does not follow the schema: {exc}") from None
    try:
        validate(m)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"{what}: {exc}") from None
    return m


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a very large number"
    return text if len(text) <= 60 else text[:57] + "..."


def _int(value: Any, what: str) -> int:
    if type(value) is not int:
        raise TypeError(f"{what} must be an integer, got {_show(value)}")
    if not -_MAX_INT < value < _MAX_INT:
        raise ValueError(f"{what} {_show(value)} is out of range (|n| < 2**63)")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {_show(value)}")
    return value


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be an object")
    return value


def _piece(raw: Any, name: str) -> Piece:
    raw = _dict(raw, f"piece of {name}")
    _only(raw, _PIECE_KEYS, f"a piece of {name}")
    rows = raw["rows"]
    if not isinstance(rows, list) or len(rows) != 2:
        raise TypeError(f"rows of a piece of {name} must be [start, stop]")
    digests = raw["digests"]
    if not isinstance(digests, list):
        raise TypeError(f"digests of a piece of {name} must be a list")
    return Piece(
        file=_str(raw["file"], "piece file"),
        offset=_int(raw["offset"], "piece offset"),
        nbytes=_int(raw["nbytes"], "piece nbytes"),
        rows=(_int(rows[0], "rows"), _int(rows[1], "rows")),
        digests=tuple(_str(d, "digest") for d in digests),
    )


def _tensor(raw: Any, name: str) -> TensorEntry:
    raw = _dict(raw, f"tensor {name}")
    _only(raw, _TENSOR_KEYS, f"tensor {name}")
    shape = raw["shape"]
    if not isinstance(shape, list):
        raise TypeError(f"shape of {name} must be a list")
    if len(shape) > MAX_NDIM:
        raise ValueError(f"tensor {name} has {len(shape)} dimensions, at most {MAX_NDIM}")
    owner = raw.get("owner")
    return TensorEntry(
        dtype=_str(raw["dtype"], "dtype"),
        shape=tuple(_int(s, "shape") for s in shape),
        kind=_str(raw["kind"], "kind"),  # type: ignore[arg-type]  # checked by validate()
        pieces=tuple(_piece(p, name) for p in raw["pieces"]),
        owner=None if owner is None else _int(owner, "owner"),
    )


_TOP_LEVEL = frozenset(
    {"format_version", "job", "step", "generation", "world_size", "parallelism", "block_size", "parent_step",
     "spec_hash", "data_version", "files", "tensors", "meta", "rank_meta", "metrics", "run_record"}
)  # fmt: skip
_TENSOR_KEYS = frozenset({"dtype", "shape", "kind", "owner", "pieces"})
_PIECE_KEYS = frozenset({"file", "offset", "nbytes", "rows", "digests"})


def _only(raw: dict[str, Any], allowed: frozenset[str], what: str) -> None:
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ValueError(f"{what} has fields outside the schema: {', '.join(map(repr, unknown[:5]))}")


def _from_dict(raw: Any) -> Manifest:
    raw = _dict(raw, "manifest")
    _only(raw, _TOP_LEVEL, "manifest")
    parent = raw.get("parent_step")
    metrics = _dict(raw.get("metrics", {}), "metrics")
    return Manifest(
        format_version=_int(raw["format_version"], "format_version"),
        job=_str(raw["job"], "job"),
        step=_int(raw["step"], "step"),
        generation=_int(raw["generation"], "generation"),
        world_size=_int(raw["world_size"], "world_size"),
        parallelism=_str(raw["parallelism"], "parallelism"),
        block_size=_int(raw["block_size"], "block_size"),
        parent_step=None if parent is None else _int(parent, "parent_step"),
        spec_hash=_str(raw.get("spec_hash", ""), "spec_hash"),
        data_version=_str(raw.get("data_version", ""), "data_version"),
        files={
            n: FileEntry(size=_int(f["size"], "file size"), digest=_str(f["digest"], "file digest"))
            for n, f in _dict(raw["files"], "files").items()
        },
        tensors={n: _tensor(t, n) for n, t in _dict(raw["tensors"], "tensors").items()},
        meta=_dict(raw.get("meta", {}), "meta"),
        rank_meta={
            k: _dict(v, "rank_meta entry") for k, v in _dict(raw.get("rank_meta", {}), "rank_meta").items()
        },
        metrics={k: float(v) for k, v in metrics.items()},
        run_record=_dict(raw.get("run_record", {}), "run_record"),
    )


# ---------------------------------------------------------------- validation


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
