"""Will the built-in data fit? An estimate before anything is allocated (torch-free).

``data.samples`` passes the schema at any size up to its bound, but the built-in generated sets
live in memory, built by every process of a node at once: 5e7 samples of ``synthetic`` ended in
numpy's ``_ArrayMemoryError`` (a traceback, exit 1). :func:`check_builtin_fits` refuses such a
size first, with a :class:`SpecError` naming the field, the estimate, what is available and the
largest size that fits (exit 2 before any process group starts). The estimate is the peak of
building one split (the generator's float64 draws before the float32 copy, the intermediate
products), per sample, times the processes on this node (``LOCAL_WORLD_SIZE``, which torchrun
sets); available is the smaller of ``MemAvailable`` and the cgroup's limit less its usage.
Unknown (no ``/proc``): no check. :func:`out_of_memory` turns a ``MemoryError`` raised while
data or a model is built anyway into the same kind of line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from worker.errors import SpecError

_GIB = 1 << 30
HEADROOM = 0.8
"""The share of the available memory the data may take (the model, torch and the rest need some)."""


def builtin_bytes(name: str, samples: int, kwargs: Mapping[str, Any]) -> int:
    """About how many bytes building ``samples`` samples of built-in ``name`` takes at its peak."""
    if name == "synthetic":
        d_in = int(kwargs.get("input_dim", 16))
        d_out = max(int(kwargs.get("output_dim", 4)), int(kwargs.get("num_classes", 8)))
        per_sample = d_in * (8 + 4) + 32 * 4 * 3 + d_out * 4 * 4
    elif name == "tokens":
        seq_len = int(kwargs.get("seq_len", 16))
        per_sample = (seq_len + 1) * 8 + seq_len * 8 + 2 * seq_len * 8
    else:
        return 0
    return samples * per_sample


def check_builtin_fits(
    name: str,
    samples: int,
    kwargs: Mapping[str, Any],
    *,
    field: str,
    available: int | None = None,
    processes: int | None = None,
) -> None:
    """Raise :class:`SpecError` when ``samples`` of built-in ``name`` cannot be built by each
    process of this node (``available`` and ``processes`` default to this machine's)."""
    available = available_memory() if available is None else available
    processes = local_processes() if processes is None else processes
    need = builtin_bytes(name, samples, kwargs)
    if available is None or need == 0 or need * processes <= HEADROOM * available:
        return
    per_sample = max(1, need // max(samples, 1))
    fits = int(HEADROOM * available / processes / per_sample)
    each = f" in each of the {processes} processes on this node" if processes > 1 else ""
    raise SpecError(
        f"field '{field}': {samples} samples of the built-in '{name}' data need about "
        f"{need / _GIB:.1f} GiB to build{each}, and {available / _GIB:.1f} GiB of memory are "
        f"available here; give at most {fits} samples, or use a data factory that reads from disk"
    )


def out_of_memory(field: str, what: str) -> SpecError:
    """The line for a ``MemoryError`` (or torch's allocator failure) while building ``what``."""
    return SpecError(
        f"field '{field}': ran out of memory building {what}; give smaller sizes, or run on a "
        "machine with more memory"
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """numpy's ``_ArrayMemoryError`` is a MemoryError; torch's CPU allocator raises a
    RuntimeError that says it could not allocate."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in text or "not enough memory" in text)


def local_processes() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def available_memory(proc: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still allocate: ``MemAvailable``, lowered by a cgroup v2 or v1
    limit; None when neither can be read."""
    found: list[int] = []
    try:
        for line in proc.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            found.append(max(0, int(limit) - usage))
    return min(found) if found else None
