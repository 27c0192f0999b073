"""The on-disk layout of a job's checkpoint directory, and the durable file operations (torch-free).

::

    <job dir>/step-00000120/manifest.json    published: complete, renamed into place
    <job dir>/step-00000120/rank-00000.bin   one shard file per writing rank
    <job dir>/latest                         "step-00000120\\n", moved only after the step is durable
    <job dir>/.staging-00000140-2/           phase 1 of step 140 in generation 2; never read
    <job dir>/.trash-...                     a step or staging directory being deleted

A step directory exists only after its manifest was fsynced and it was renamed from staging, so
a loader that lists ``step-*`` never sees a half-written step. Every reader of a published step
reads its manifest through :func:`load_manifest` (limits, and the files checked on disk).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from pathlib import Path

from worker.checkpoint import manifest as _manifest
from worker.checkpoint.manifest import MANIFEST_NAME, Manifest, manifest_from_json
from worker.errors import CheckpointError, CorruptCheckpointError

LATEST = "latest"
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_STAGING_RE = re.compile(r"^\.staging-(\d{8,})-(\d+)$")
EXPORT_MARKER = "EXPORT.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def staging_dir_name(step: int, generation: int) -> str:
    return f".staging-{step:08d}-{generation}"


def shard_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def parse_step_dir(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def parse_staging_dir(name: str) -> tuple[int, int] | None:
    match = _STAGING_RE.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write a new file and fsync it (not its directory)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def file_sizes(directory: Path) -> dict[str, int]:
    """The sizes of the plain files in ``directory`` (a staging directory): what a coordinator
    compares with the ranks' reports before publishing. Empty when the directory is gone."""
    try:
        return {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}
    except FileNotFoundError:
        return {}


def list_published(job_dir: Path) -> list[tuple[int, Path]]:
    """Published step directories (those holding a manifest), oldest first."""
    out = []
    try:
        entries = list(os.scandir(job_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        step = parse_step_dir(entry.name)
        if step is not None and entry.is_dir() and (Path(entry.path) / MANIFEST_NAME).is_file():
            out.append((step, Path(entry.path)))
    return sorted(out)


def read_latest(job_dir: Path) -> str | None:
    """The step directory name ``latest`` points at, or None."""
    try:
        text = (job_dir / LATEST).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return text if parse_step_dir(text) is not None else None


def write_latest(job_dir: Path, step: int) -> None:
    """Atomically point ``latest`` at ``step``: temp file, fsync, rename, fsync the directory."""
    tmp = job_dir / f".{LATEST}.tmp-{os.getpid()}"
    write_durable(tmp, (step_dir_name(step) + "\n").encode())
    os.replace(tmp, job_dir / LATEST)
    fsync_dir(job_dir)


def remove_tree(path: Path) -> None:
    """Delete a directory so no reader sees it half-deleted: rename to ``.trash-*`` first."""
    if not path.exists():
        return
    trash = path.parent / f".trash-{path.name.lstrip('.')}-{os.getpid()}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def collect_orphans(job_dir: Path, *, current_generation: int) -> list[str]:
    """Remove staging directories of other generations, trash and stale temp files.

    Staging directories of ``current_generation`` are left alone: at the start of a generation
    there are none, and later ones belong to a save in flight. Returns the names removed.
    """
    removed = []
    try:
        entries = list(os.scandir(job_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        staged = parse_staging_dir(entry.name)
        if (staged is not None and staged[1] != current_generation) or entry.name.startswith(".trash-"):
            shutil.rmtree(entry.path, ignore_errors=True)
        elif entry.name.startswith(f".{LATEST}.tmp-"):
            os.unlink(entry.path)
        else:
            continue
        removed.append(entry.name)
    return removed


def resolve_checkpoint(path: str | Path) -> Path:
    """A step directory from a step directory or a job directory (``latest``, else the newest
    published step). Raises :class:`CheckpointError` saying what the path is instead."""
    p = Path(path)
    if parse_staging_dir(p.name) is not None:
        raise CheckpointError(f"{p} is a staging directory of an unpublished save; those are never read")
    if (p / MANIFEST_NAME).is_file():
        return p
    if (p / EXPORT_MARKER).is_file():
        raise CheckpointError(
            f"{p} is a weights-only export; it cannot resume training or be inspected as a checkpoint"
        )
    if not p.is_dir():
        raise CheckpointError(f"{p} does not exist or is not a directory")
    latest = read_latest(p)
    if latest is not None and (p / latest / MANIFEST_NAME).is_file():
        return p / latest
    published = list_published(p)
    if published:
        return published[-1][1]
    raise CheckpointError(f"{p} holds no published checkpoint (no step-*/manifest.json and no 'latest')")


# ---------------------------------------------------------------- reading a manifest


def load_manifest(step_dir: Path, *, check_files: bool = True) -> Manifest:
    """The manifest of a published step, read with limits (it is untrusted input): a regular file of at most
    :func:`worker.checkpoint.manifest.manifest_cap` bytes (checked before reading; the bytes of
    the step's other files on disk are counted only when the manifest is over the base cap),
    parsed with the depth cap and the schema, and, with ``check_files``, every shard it lists
    present with the size it claims, so no number in it sizes a read or a buffer beyond the
    files really there. Raises :class:`CorruptCheckpointError` (one line naming the file):
    refused like a corrupt shard. ``check_files=False`` is for ``verify``, which reports each
    shard's problem itself."""
    path = step_dir / MANIFEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the open
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{step_dir}: manifest.json is missing") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(f"{path}: not a regular file")
        cap = _manifest.manifest_cap(0)
        if info.st_size > cap:
            others = _other_bytes(step_dir)
            cap = _manifest.manifest_cap(others)
            if info.st_size > cap:
                raise CorruptCheckpointError(
                    f"{path}: {info.st_size} bytes is over the limit of {cap} bytes for a step with "
                    f"{others} bytes of shards"
                )
        data = _read_at_most(fd, cap + 1)
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
    m = manifest_from_json(data, what=str(path), max_bytes=cap)
    if check_files:
        for name, entry in sorted(m.files.items()):
            problem = shard_problem(step_dir / name, entry.size)
            if problem:
                raise CorruptCheckpointError(problem)
    return m


def shard_problem(path: Path, expected: int, actual: int | None = -1) -> str:
    """What is wrong with a shard file that should be ``expected`` bytes ('' if nothing).
    ``actual``: its size when the caller has it (None: missing); -1: look it up."""
    if actual == -1:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            actual = None
        else:
            if not stat.S_ISREG(info.st_mode):
                return f"{path}: not a regular file"
            actual = info.st_size
    if actual is None:
        return f"{path}: shard file is missing"
    if actual != expected:
        hint = "truncated?" if actual < expected else "not the file the manifest describes?"
        return f"{path}: {actual} bytes on disk, the manifest says {expected} ({hint})"
    return ""


def _other_bytes(step_dir: Path) -> int:
    total = 0
    with os.scandir(step_dir) as entries:
        for entry in entries:
            if entry.name != MANIFEST_NAME and entry.is_file():
                total += entry.stat().st_size
    return total


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks, total = [], 0
    while total < limit:
        chunk = os.read(fd, min(limit - total, 16 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)
