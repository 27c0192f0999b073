from __future__ import annotations

import os

from hypothesis import given
from hypothesis import strategies as st

from worker.checkpoint.blocks import BlockHasher, block_digests, file_digest


@given(data=st.binary(max_size=300), cuts=st.lists(st.integers(0, 300), max_size=6), block=st.integers(1, 64))
def test_streamed_equals_one_shot(data: bytes, cuts: list[int], block: int) -> None:
    h = BlockHasher(block)
    pos = 0
    for cut in sorted(cuts):
        h.update(data[pos:cut])
        pos = max(pos, cut)
    h.update(data[pos:])
    assert h.finish() == block_digests(data, block)


def test_block_count_and_file_digest_sensitivity() -> None:
    data = os.urandom(100)
    digests = block_digests(data, 32)
    assert len(digests) == 4
    assert file_digest(100, digests) != file_digest(101, digests)
    flipped = bytearray(data)
    flipped[70] ^= 1
    other = block_digests(bytes(flipped), 32)
    assert [a == b for a, b in zip(digests, other, strict=True)] == [True, True, False, True]
    assert file_digest(100, digests) != file_digest(100, other)
