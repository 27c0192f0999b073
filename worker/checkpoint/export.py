"""Weights-only exports people can load elsewhere (``elastrain checkpoint export-weights``).

Torch-free for the default format: ``DST/model.safetensors`` is written by the ``safetensors``
package from the verified logical bytes of the model tensors (streamed through a temporary
file that is memory-mapped, so memory stays bounded whatever the model's size), plus
``EXPORT.json`` saying it cannot resume training. ``fmt="torch"`` writes
``DST/pytorch_model.bin`` (a ``torch.save`` state dict; torch is imported for that format only).

* Names: a checkpoint's ``model.<fqn>`` become ``<fqn>``, without ``strip_prefix`` (default: the
  place of the Hugging Face model the checkpoint recorded, e.g. ``hf.`` when a factory wraps the
  model as ``self.hf``); tensors outside the prefix are left out (and listed).
* Tied weights (the manifest's aliases) are stored once, as Hugging Face's ``save_pretrained``
  does (safetensors: the first name only, the others in the metadata ``elastrain_aliases``;
  torch: both names on one storage). ``from_pretrained`` re-ties them.
* ``dtype`` (``fp32``, ``fp16``, ``bf16``) converts floating tensors the way torch does (round to
  nearest even; NaN to the canonical quiet NaN for bf16); other tensors are kept as they are.
* ``config.json``: when the checkpoint recorded a Hugging Face config (:func:`hf_config_of`, at
  save time) and the exported names are that model's own (the prefix stripped is its place),
  the config is written beside the weights, with ``architectures`` and ``dtype``, so
  ``AutoModel*.from_pretrained(DST)`` builds the same model and loads the weights.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from worker.checkpoint.layout import EXPORT_MARKER, fsync_dir, write_durable
from worker.checkpoint.manifest import Manifest
from worker.checkpoint.places import load_manifest, reader, resolve_checkpoint
from worker.checkpoint.shardio import ShardReader
from worker.checkpoint.verify import iter_tensor_bytes, logical_digest
from worker.errors import CheckpointError

WEIGHTS_PREFIX = "model."
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
FORMATS = {"safetensors": "model.safetensors", "torch": "pytorch_model.bin"}
_FLOATS = frozenset({"float64", "float32", "float16", "bfloat16"})


@dataclass(frozen=True, slots=True)
class ExportPlan:
    """What an export writes (pure): ``items`` are (exported name, stored name, dtype out)."""

    items: tuple[tuple[str, str, str], ...]
    aliases: dict[str, str]  # exported tied name -> exported stored name
    strip_prefix: str
    left_out: tuple[str, ...]
    config: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Exported:
    path: Path
    tensors: int
    bytes: int
    strip_prefix: str
    config_written: bool
    left_out: tuple[str, ...] = field(default=())


def hf_config_of(model: Any) -> dict[str, Any] | None:
    """At save time: the Hugging Face config of the first module (the model itself or a
    submodule) whose ``config`` has ``to_dict()`` and a ``model_type``, with its place in the
    model (``prefix``) and class (``architectures``); None when there is none."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if not callable(getattr(config, "to_dict", None)) or not isinstance(
            getattr(config, "model_type", None), str
        ):
            continue
        cls = type(module)
        if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2:  # FSDP2's dynamic subclass
            cls = cls.__bases__[1]
        body = json.loads(json.dumps(config.to_dict(), default=str))  # type: ignore[union-attr]  # checked
        return {"prefix": f"{name}." if name else "", "architectures": [cls.__name__], "config": body}
    return None


def plan_export(m: Manifest, *, strip_prefix: str | None = None, dtype: str | None = None) -> ExportPlan:
    """Which stored tensors are exported under which names and dtypes (see the module docs)."""
    recorded = m.meta.get("hf") if isinstance(m.meta.get("hf"), dict) else None
    prefix = strip_prefix if strip_prefix is not None else str(recorded["prefix"]) if recorded else ""
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    stored = sorted(n for n, t in m.tensors.items() if n.startswith(WEIGHTS_PREFIX) and t.kind != "per_rank")
    short = {n: n.removeprefix(WEIGHTS_PREFIX) for n in stored}
    inside = [n for n in stored if short[n].startswith(prefix) and len(short[n]) > len(prefix)]
    if stored and not inside:
        some = ", ".join(short[n] for n in stored[:3])
        raise CheckpointError(
            f"no model tensor starts with {prefix!r} (they look like {some}); pass --strip-prefix with "
            "the prefix of the module to export, or '' for all"
        )
    items = []
    for n in inside:
        src = m.tensors[n].dtype
        items.append((short[n][len(prefix) :], n, DTYPES[dtype] if dtype and src in _FLOATS else src))
    out_name = {n: name for name, n, _ in items}
    aliases = {
        alias.removeprefix(WEIGHTS_PREFIX)[len(prefix) :]: out_name[target]
        for alias, target in sorted(m.aliases.items())
        if target in out_name and alias.removeprefix(WEIGHTS_PREFIX).startswith(prefix)
    }
    left = tuple(short[n] for n in stored if n not in out_name)
    config = None
    if recorded and prefix == recorded.get("prefix") and isinstance(recorded.get("config"), dict):
        config = dict(recorded["config"]) | {"architectures": list(recorded.get("architectures") or [])}
        if dtype is not None:
            config["dtype"] = DTYPES[dtype]
    return ExportPlan(tuple(items), aliases, prefix, left, config)


def export_weights(
    src: str | Path, dst: str | Path, *, fmt: str = "safetensors", dtype: str | None = None,
    strip_prefix: str | None = None,
) -> Exported:  # fmt: skip
    """Write the model weights of ``src`` (a step or job directory, or its s3:// URL) into the
    new local directory ``dst``. The export cannot resume training: it has no optimizer state,
    progress or RNG."""
    if fmt not in FORMATS:
        raise CheckpointError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    step_dir = resolve_checkpoint(src)
    m = load_manifest(step_dir)
    out = Path(dst)
    if out.exists():
        raise CheckpointError(f"{out} already exists; choose a new directory for the export")
    plan = plan_export(m, strip_prefix=strip_prefix, dtype=dtype)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    with reader(step_dir, m) as shards:
        if fmt == "torch":
            nbytes = _write_torch(shards, plan, tmp / FORMATS[fmt])
        else:
            nbytes = _write_safetensors(shards, plan, tmp / FORMATS[fmt])
    if plan.config is not None:
        write_durable(
            tmp / "config.json", (json.dumps(plan.config, indent=2, sort_keys=True) + "\n").encode()
        )
    marker = {
        "weights_only": True, "resumable": False,
        "note": "weights-only export: no optimizer state, progress or RNG; it cannot resume training",
        "source": str(step_dir), "step": m.step, "format": fmt, "dtype": dtype, "tensors": len(plan.items),
        "bytes": nbytes, "strip_prefix": plan.strip_prefix, "tied": plan.aliases,
        "left_out": list(plan.left_out),
        "config_json": plan.config is not None, "source_logical_digest": logical_digest(step_dir),
    }  # fmt: skip
    write_durable(tmp / EXPORT_MARKER, (json.dumps(marker, indent=1) + "\n").encode())
    fsync_dir(tmp)
    os.rename(tmp, out)
    fsync_dir(out.parent)
    return Exported(out / FORMATS[fmt], len(plan.items), nbytes, plan.strip_prefix, plan.config is not None,
                    plan.left_out)  # fmt: skip


def _write_safetensors(reader: ShardReader, plan: ExportPlan, path: Path) -> int:
    from safetensors import TensorSpec, serialize_file

    m = reader.manifest
    data_path = path.with_name(".tensors.tmp")
    spans: dict[str, tuple[int, int]] = {}
    with open(data_path, "wb") as out:
        for name, stored, dtype in plan.items:
            start = out.tell()
            for chunk in iter_tensor_bytes(reader, stored):
                out.write(convert(chunk, m.tensors[stored].dtype, dtype))
            spans[name] = (start, out.tell() - start)
        total = out.tell()
    metadata = {"format": "pt", "elastrain": "weights only", "elastrain_step": str(m.step)}
    if plan.aliases:
        metadata["elastrain_aliases"] = json.dumps(plan.aliases, sort_keys=True)
    with open(data_path, "rb") as f, _mapped(f.fileno(), total) as base:
        specs = {
            name: TensorSpec(
                dtype=dtype,
                shape=list(m.tensors[stored].shape),
                data_ptr=base + spans[name][0],
                data_len=spans[name][1],
            )
            for name, stored, dtype in plan.items
        }
        serialize_file(specs, path, metadata=metadata)
    # The serializer creates its file 0600; give it the mode of a file created as usual (0666
    # less the umask, as the torch format, config.json and the marker have), read from ours.
    os.chmod(path, stat.S_IMODE(data_path.stat().st_mode))
    data_path.unlink()
    _fsync(path)
    return total


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _mapped:
    """The address of a read-only memory map of ``size`` bytes of ``fd`` (of a 1-byte buffer
    when empty), valid inside the ``with`` block (the serializer reads through raw pointers)."""

    def __init__(self, fd: int, size: int) -> None:
        self._map = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        self._view = np.frombuffer(self._map, dtype=np.uint8) if self._map else np.zeros(1, np.uint8)

    def __enter__(self) -> int:
        return int(self._view.ctypes.data)

    def __exit__(self, *exc: object) -> None:
        del self._view
        if self._map is not None:
            self._map.close()


def _write_torch(reader: ShardReader, plan: ExportPlan, path: Path) -> int:
    import torch

    m = reader.manifest
    state: dict[str, Any] = {}
    total = 0
    for name, stored, dtype in plan.items:
        entry = m.tensors[stored]
        data = b"".join(bytes(c) for c in iter_tensor_bytes(reader, stored))
        flat = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        tensor = flat.view(getattr(torch, entry.dtype)).reshape(entry.shape).to(getattr(torch, dtype))
        state[name] = tensor
        total += tensor.numel() * tensor.element_size()
    for alias, target in plan.aliases.items():
        state[alias] = state[target]  # one storage in the file; both names load
    torch.save(state, path)
    _fsync(path)
    return total


def convert(data: bytes | memoryview, src: str, dst: str) -> bytes | memoryview:
    """Raw little-endian values of dtype ``src`` as dtype ``dst`` (floating dtypes), the way
    torch converts them; the input itself when the dtypes are equal."""
    if src == dst:
        return data
    if src not in _FLOATS or dst not in _FLOATS:
        raise CheckpointError(f"cannot convert {src} to {dst}")
    x = _as_float32(data, src)  # float64 too: torch rounds it through float32 as well
    if dst == "float64":
        return x.astype(np.float64).tobytes()
    if dst == "float32":
        return x.tobytes()
    if dst == "float16":
        with np.errstate(over="ignore"):  # beyond 65504 is inf, as in torch
            return x.astype(np.float16).tobytes()
    bits = x.view(np.uint32)
    rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)  # nearest even
    rounded[np.isnan(x)] = 0x7FC0
    return rounded.tobytes()


def _as_float32(data: bytes | memoryview, src: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    if src == "float32":
        return np.frombuffer(data, dtype=np.float32)
    if src == "float16":
        return np.frombuffer(data, dtype=np.float16).astype(np.float32)
    if src == "bfloat16":
        return (np.frombuffer(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(data, dtype=np.float64).astype(np.float32)
