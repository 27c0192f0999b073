"""A job's checkpoints on S3: the layout of ``layout.py`` without rename (torch-free).

::

    s3://bucket/prefix/step-00000120/rank-00000.bin   uploaded in phase 1 (multipart, parallel)
    s3://bucket/prefix/step-00000120/manifest.json    written last, create-only: the commit point
    s3://bucket/prefix/latest                         replaced only on an unchanged ETag

An object store has no atomic rename, so a step counts as published exactly when its
``manifest.json`` exists; shards under a step without one are never read and are removed at the
next start and after each publish (:func:`collect_unpublished`, which also aborts the multipart
uploads a killed writer left open) or by an abort. The manifest is created with
``If-None-Match: *``, so two writers of one step cannot both commit, and ``latest`` moves with
``If-Match`` on the ETag read, so it never moves backwards under a race.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from worker.checkpoint.blocks import block_digests, file_digest
from worker.checkpoint.layout import LATEST, parse_step_dir, shard_problem, step_dir_name
from worker.checkpoint.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    Piece,
    check_readable,
    manifest_cap,
    manifest_from_json,
    manifest_to_json,
)
from worker.checkpoint.saveplan import Assignment
from worker.checkpoint.shardio import ShardReader
from worker.checkpoint.storage import PART_SIZE, StorageError, storage_for
from worker.errors import CheckpointError, CorruptCheckpointError
from worker.failpoints import failpoint
from worker.jobspec.location import S3Location

log = logging.getLogger("elastrain.checkpoint")


def upload_shard(
    target: S3Location,
    items: Sequence[tuple[Assignment, memoryview]],
    *,
    block_size: int,
    after_first_piece: Callable[[], object] | None = None,
) -> tuple[list[tuple[str, Piece]], FileEntry]:
    """Upload ``items`` back to back as one object ``target`` (multipart, parts in parallel,
    streamed from the views: at most a few parts buffered), with the block digests of
    ``shardio.write_shard``. Raises :class:`StorageError`."""
    pieces: list[tuple[str, Piece]] = []
    all_blocks: list[str] = []
    offset = 0
    views = []
    for a, data in items:
        view = memoryview(data).cast("B")
        digests = block_digests(view, block_size)
        pieces.append((a.name, Piece(target.name, offset, len(view), (a.start, a.stop), tuple(digests))))
        all_blocks.extend(digests)
        offset += len(view)
        views.append(view)

    def chunks() -> Iterator[memoryview]:
        for i, view in enumerate(views):
            for pos in range(0, len(view), PART_SIZE):
                yield view[pos : pos + PART_SIZE]
            if i == 0 and after_first_piece is not None:
                after_first_piece()

    storage_for(target).write(target.prefix, chunks() if offset else b"")  # type: ignore[arg-type]
    return pieces, FileEntry(size=offset, digest=file_digest(offset, all_blocks))


def is_published(step: S3Location) -> bool:
    return storage_for(step).head(step.key(MANIFEST_NAME)) is not None


def object_sizes(step: S3Location) -> dict[str, int]:
    """The sizes of the objects directly under a step's prefix (what phase 2 compares with the
    ranks' reports)."""
    _, objects = storage_for(step).listing(step.prefix)
    return {o.key.rsplit("/", 1)[-1]: o.size for o in objects}


def list_published(job: S3Location) -> list[tuple[int, S3Location]]:
    """Published steps (those with a manifest), oldest first: one recursive listing."""
    _, objects = storage_for(job).listing(job.prefix, recursive=True)
    base = f"{job.prefix}/" if job.prefix else ""
    out = []
    for o in objects:
        parts = o.key[len(base) :].split("/")
        if len(parts) == 2 and parts[1] == MANIFEST_NAME:
            step = parse_step_dir(parts[0])
            if step is not None:
                out.append((step, job / parts[0]))
    return sorted(out, key=lambda t: t[0])


def read_latest(job: S3Location) -> tuple[str | None, str]:
    """(the step name ``latest`` points at or None, its ETag or '' when absent)."""
    info = storage_for(job).head(job.key(LATEST))
    if info is None:
        return None, ""
    text = storage_for(job).read(job.key(LATEST)).decode("utf-8", "replace").strip()
    return (text if parse_step_dir(text) is not None else None), info.etag


def load_manifest(step: S3Location, *, check_files: bool = True) -> Manifest:
    """A published step's manifest, read with the limits of ``layout.load_manifest`` and, with
    ``check_files``, every shard present with its size. Raises :class:`CorruptCheckpointError`
    for what is wrong with the step, :class:`StorageError` when the store cannot be read (not a
    reason to set the step aside)."""
    store = storage_for(step)
    sizes = object_sizes(step)
    size = sizes.pop(MANIFEST_NAME, None)
    if size is None:
        raise CorruptCheckpointError(f"{step}: manifest.json is missing")
    cap = manifest_cap(0)
    if size > cap:
        cap = manifest_cap(sum(sizes.values()))
        if size > cap:
            raise CorruptCheckpointError(f"{step}/{MANIFEST_NAME}: {size} bytes is over the limit of {cap}")
    data = store.read(step.key(MANIFEST_NAME))
    m = manifest_from_json(data, what=f"{step}/{MANIFEST_NAME}", max_bytes=cap)
    if check_files:
        for name, entry in sorted(m.files.items()):
            problem = shard_problem(step / name, entry.size, sizes.get(name))  # type: ignore[arg-type]
            if problem:
                raise CorruptCheckpointError(problem)
    return m


def resolve_checkpoint(loc: S3Location) -> S3Location:
    """A step from a step or job location: ``latest``, else the newest published step."""
    if parse_step_dir(loc.name) is not None:
        return loc
    latest, _ = read_latest(loc)
    published = list_published(loc)
    names = {p.name: p for _, p in published}
    if latest is not None and latest in names:
        return names[latest]
    if published:
        return published[-1][1]
    raise CheckpointError(f"{loc} holds no published checkpoint (no step-*/manifest.json and no 'latest')")


def publish(job: S3Location, manifest: Manifest) -> S3Location:
    """Commit a step whose shards are uploaded: create its manifest (``If-None-Match: *``), then
    move ``latest`` forward. Idempotent: a manifest of the same step already there is kept."""
    step = job / step_dir_name(manifest.step)
    text = manifest_to_json(manifest)
    check_readable(text, manifest.total_bytes)
    failpoint("before_manifest_write")
    if storage_for(job).create(step.key(MANIFEST_NAME), text.encode()) is None:
        existing = load_manifest(step, check_files=False)
        if existing.step != manifest.step:
            raise CheckpointError(f"{step}: a manifest of step {existing.step} is already there")
    failpoint("after_publish_rename")
    move_latest(job, manifest.step)
    return step


def move_latest(job: S3Location, step: int, *, backwards: bool = False) -> None:
    """Point ``latest`` at ``step`` with a conditional write; never backwards unless asked (a
    rollback). Retries when another writer moved it in between."""
    store = storage_for(job)
    body = (step_dir_name(step) + "\n").encode()
    for _ in range(10):
        current, etag = read_latest(job)
        current_step = parse_step_dir(current) if current else None
        if current_step == step or (current_step is not None and current_step > step and not backwards):
            return
        failpoint("before_latest_update")
        done = store.replace(job.key(LATEST), body, etag) if etag else store.create(job.key(LATEST), body)
        if done is not None:
            failpoint("after_latest_update")
            return
    raise CheckpointError(f"{job}/{LATEST}: kept changing under this writer; not moved to step {step}")


def abort(step: S3Location, reason: str) -> int:
    """Remove the shards of an unpublished step (never a published one) and log why; returns
    how many objects were removed."""
    sizes = object_sizes(step)
    if MANIFEST_NAME in sizes or not sizes:
        return 0
    log.warning("checkpoint save aborted: %s (removing %s)", reason, step)
    storage_for(step).delete([step.key(name) for name in sizes])
    return len(sizes)


def delete_step(step: S3Location) -> None:
    """Delete a step: its manifest first (from then on it is not published, so no reader can
    see it half-deleted), then its shards."""
    store = storage_for(step)
    store.delete([step.key(MANIFEST_NAME)])
    store.delete([step.key(name) for name in object_sizes(step)])


def collect_unpublished(job: S3Location, *, below: int | None = None) -> list[str]:
    """Remove what saves that never committed left under ``job``: the shards under step
    prefixes without a manifest, and the multipart uploads left open there (a writer killed
    mid-upload). ``below=None``: every step, only when no save of this job is in flight (at a
    generation's opening); ``below=N``: only steps before N, right after step N was published
    (saves are published in order, so an earlier step without a manifest was abandoned; a later
    one may be in flight). Returns the steps whose shards or uploads were removed."""
    store = storage_for(job)
    dirs, _ = store.listing(job.prefix)
    published = {p.name for _, p in list_published(job)}

    def before(name: str) -> bool:
        step = parse_step_dir(name)
        return step is not None and (below is None or step < below)

    removed = set()
    for d in dirs:
        name = d.rsplit("/", 1)[-1]
        if before(name) and name not in published and abort(job / name, "unpublished"):
            removed.add(name)
    base = f"{job.prefix}/" if job.prefix else ""
    try:
        left_open = [u for u in store.uploads(base) if before(u.key[len(base) :].split("/", 1)[0])]
        if left_open:
            log.warning("aborting %d multipart uploads left open under %s", len(left_open), job)
            store.abort_uploads(left_open)
    except StorageError as exc:  # a store without these calls: its lifecycle rules must do it
        log.warning("open multipart uploads under %s not collected: %s", job, exc)
        left_open = []
    removed.update(u.key[len(base) :].split("/", 1)[0] for u in left_open)
    return sorted(removed)


def set_aside(step: S3Location, tag: str) -> str:
    """Unpublish a step so no resume mixes two histories: its manifest is copied to
    ``.<tag>-step-N.json`` beside the steps, then deleted. Returns the copy's name."""
    store = storage_for(step)
    aside = f".{tag}-{step.name}.json"
    store.write(step.parent.key(aside), store.read(step.key(MANIFEST_NAME)))
    store.delete([step.key(MANIFEST_NAME)])
    return aside


class ObjectShardReader(ShardReader):
    """:class:`ShardReader` on a published step in S3: ranged reads of exactly the planned
    bytes, every block verified by the same code as on disk. A store that cannot be read raises
    :class:`StorageError`: the restore fails (torchrun restarts it) instead of refusing a step
    that may be intact."""

    def __init__(self, step: S3Location, manifest: Manifest) -> None:
        super().__init__(step, manifest)  # type: ignore[arg-type]
        self._loc = step
        self._sizes: dict[str, int] | None = None

    def close(self) -> None:
        pass

    def _fd(self, name: str) -> int:
        if self._sizes is None:
            self._sizes = object_sizes(self._loc)
        problem = shard_problem(self._loc / name, self.manifest.files[name].size, self._sizes.get(name))  # type: ignore[arg-type]
        if problem:
            raise CorruptCheckpointError(problem)
        return 0

    def _pread_into(self, op, view: memoryview) -> None:  # type: ignore[no-untyped-def]
        storage_for(self._loc).read_into(self._loc.key(op.file), op.offset, view[: op.nbytes])
        self.bytes_read += op.nbytes
