"""``manifest.json`` to and from the values: deterministic text out; in, the depth-capped parse,
the schema (nothing outside it, integers bounded) and the layout rules (pure)."""

from __future__ import annotations

import json
from typing import Any

from worker.checkpoint.manifest.model import (
    MAX_DEPTH,
    MAX_NDIM,
    FileEntry,
    Manifest,
    Piece,
    TensorEntry,
)
from worker.checkpoint.manifest.rules import validate
from worker.errors import CorruptCheckpointError
from worker.jobspec.jsonlimits import JSONRefused, loads

_MAX_INT = 1 << 63


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
    } | ({"aliases": dict(sorted(m.aliases.items()))} if m.aliases else {})


def manifest_to_json(m: Manifest) -> str:
    """Deterministic JSON text (sorted files and tensors): a line per field and per tensor, each
    line compact, so that C's JSON encoder writes it (``indent`` would take the pure-Python
    encoder, many times slower on the block digests of a large state)."""
    lines = []
    for key, value in manifest_to_dict(m).items():
        if key == "tensors" and value:
            body = ",\n".join(f"  {_compact(k)}: {_compact(v)}" for k, v in value.items())
            lines.append(f' "tensors": {{\n{body}\n }}')
        else:
            lines.append(f" {_compact(key)}: {_compact(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


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
     "spec_hash", "data_version", "files", "tensors", "meta", "rank_meta", "metrics", "run_record", "aliases"}
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
        aliases={
            _str(k, "alias name"): _str(v, f"alias {k}")
            for k, v in _dict(raw.get("aliases", {}), "aliases").items()
        },
    )
