"""Shard file I/O: write pieces with block digests, read byte ranges and verify them (torch-free).

Callers hand in byte views (``memoryview``) of tensor memory; nothing here knows about torch.
A rank's shard file is its pieces packed back to back; the writer returns the piece records and
the file entry its report needs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import xxhash

from worker.checkpoint.blocks import block_digests, file_digest
from worker.checkpoint.layout import shard_problem
from worker.checkpoint.loadplan import ReadOp
from worker.checkpoint.manifest import FileEntry, Manifest, Piece
from worker.checkpoint.saveplan import Assignment
from worker.errors import CorruptCheckpointError

_MAX_WRITE = 1 << 30


def _write_all(fd: int, view: memoryview) -> None:
    pos = 0
    while pos < len(view):
        pos += os.write(fd, view[pos : pos + _MAX_WRITE])


def write_shard(
    path: Path,
    items: Sequence[tuple[Assignment, memoryview]],
    *,
    block_size: int,
    after_first_piece: Callable[[], object] | None = None,
) -> tuple[list[tuple[str, Piece]], FileEntry]:
    """Write ``items`` (assignment, its bytes) to a new file, digest every block, fsync.

    Raises OSError (e.g. ENOSPC) as it comes; the caller aborts the save and removes staging.
    """
    pieces: list[tuple[str, Piece]] = []
    all_blocks: list[str] = []
    offset = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for i, (a, data) in enumerate(items):
            view = memoryview(data).cast("B")
            digests = block_digests(view, block_size)
            _write_all(fd, view)
            pieces.append((a.name, Piece(path.name, offset, len(view), (a.start, a.stop), tuple(digests))))
            all_blocks.extend(digests)
            offset += len(view)
            if i == 0 and after_first_piece is not None:
                after_first_piece()
        os.fsync(fd)
    finally:
        os.close(fd)
    return pieces, FileEntry(size=offset, digest=file_digest(offset, all_blocks))


class ShardReader:
    """Reads planned ranges from one step directory, verifying every block it uses."""

    def __init__(self, step_dir: Path, manifest: Manifest) -> None:
        self.step_dir = step_dir
        self.manifest = manifest
        self._fds: dict[str, int] = {}
        self._scratch = bytearray()
        self.bytes_read = 0

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            expected = self.manifest.files[name].size
            try:
                fd = os.open(self.step_dir / name, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{self.step_dir / name}: shard file is missing") from None
            problem = shard_problem(self.step_dir / name, expected, os.fstat(fd).st_size)
            if problem:
                os.close(fd)
                raise CorruptCheckpointError(problem)
            self._fds[name] = fd
        return fd

    def _pread_into(self, op: ReadOp, view: memoryview) -> None:
        fd, pos = self._fd(op.file), 0
        while pos < op.nbytes:
            got = os.preadv(fd, [view[pos:]], op.offset + pos)
            if got == 0:
                raise CorruptCheckpointError(
                    f"{self.step_dir / op.file} offset {op.offset + pos}: unexpected end of file (truncated?)"
                )
            pos += got
        self.bytes_read += op.nbytes

    def _verify(self, op: ReadOp, view: memoryview) -> None:
        for c in op.checks:
            if xxhash.xxh3_128_hexdigest(view[c.offset : c.offset + c.nbytes]) != c.digest:
                raise CorruptCheckpointError(
                    f"{self.step_dir / op.file} offset {op.offset + c.offset}: block digest mismatch "
                    f"({c.nbytes} bytes)"
                )

    def run(self, ops: Sequence[ReadOp], buffers: Mapping[tuple[str, int], memoryview]) -> None:
        """Execute ``ops``; ``buffers[(name, need_start)]`` is the byte view each need fills.

        A read that lands exactly on one need goes straight into its buffer (no copy); others go
        through a scratch buffer. Raises :class:`CorruptCheckpointError` naming file and offset.
        """
        for op in ops:
            self._fd(op.file)  # the file is there with the size the manifest says before any buffer
            direct = len(op.copies) == 1 and op.copies[0].src == 0 and op.copies[0].nbytes == op.nbytes
            if direct:
                c = op.copies[0]
                view = buffers[(c.name, c.need_start)][c.dst : c.dst + c.nbytes]
                self._pread_into(op, view)
                self._verify(op, view)
                continue
            if len(self._scratch) < op.nbytes:
                self._scratch = bytearray(op.nbytes)
            view = memoryview(self._scratch)[: op.nbytes]
            self._pread_into(op, view)
            self._verify(op, view)
            for c in op.copies:
                buffers[(c.name, c.need_start)][c.dst : c.dst + c.nbytes] = view[c.src : c.src + c.nbytes]
