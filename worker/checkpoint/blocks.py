"""Block digests: xxh3-128 over fixed-size blocks of each piece (torch-free).

A reader that needs some rows of a piece reads the blocks that hold them and checks exactly
those blocks, so no byte it uses goes unverified and it never reads a whole shard to check a
slice. xxhash releases the GIL, so hashing in a background writer does not stall training.
"""

from __future__ import annotations

import xxhash

# Small enough that a rank loading a slice of a piece reads little beyond it (a reshard reads
# whole blocks: at 4 MiB a W'=3 rank of a W=2 FSDP checkpoint of 1024x1024 fp32 tensors read
# 3.0x the bytes it needed, at 256 KiB 1.13x), large enough that the digests stay ~0.02% of
# the data and hashing costs the same per byte (measured: 200 MiB in 33-37 ms at 4 MiB, 1 MiB
# and 256 KiB blocks).
DEFAULT_BLOCK_SIZE = 256 << 10


def block_digests(data: memoryview | bytes, block_size: int) -> list[str]:
    """Hex digests of ``data`` cut into ``block_size`` blocks (the last may be shorter)."""
    view = memoryview(data).cast("B")
    return [xxhash.xxh3_128_hexdigest(view[i : i + block_size]) for i in range(0, len(view), block_size)]


def file_digest(size: int, block_digest_hex: list[str]) -> str:
    """A file's digest: xxh3-128 over its size and its pieces' block digests in offset order.

    Every byte of a file belongs to exactly one block (the manifest validator enforces that the
    pieces tile the file), so this digest changes whenever any byte does, without a second pass
    over the data.
    """
    h = xxhash.xxh3_128()
    h.update(size.to_bytes(8, "little"))
    for d in block_digest_hex:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


class BlockHasher:
    """Block digests of a byte stream fed in arbitrary chunks (for streamed writers)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.digests: list[str] = []
        self._h = xxhash.xxh3_128()
        self._filled = 0

    def update(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        pos = 0
        while pos < len(view):
            take = min(self.block_size - self._filled, len(view) - pos)
            self._h.update(view[pos : pos + take])
            self._filled += take
            pos += take
            if self._filled == self.block_size:
                self._finish_block()

    def _finish_block(self) -> None:
        self.digests.append(self._h.hexdigest())
        self._h = xxhash.xxh3_128()
        self._filled = 0

    def finish(self) -> list[str]:
        if self._filled:
            self._finish_block()
        return self.digests
