"""The pure parts of the state transfer: how the flat byte stream is cut into chunks, and the
per-chunk digest that refuses a corrupt chunk."""

from __future__ import annotations

import pytest

from worker.recovery.transfer import intact, seal, segments


@pytest.mark.parametrize(
    ("sizes", "chunk"),
    [([10, 20, 5], 8), ([64], 64), ([64], 7), ([0, 3, 0, 9], 4), ([1] * 20, 3), ([100, 1], 1000)],
)
def test_segments_cover_the_stream_exactly_once(sizes: list[int], chunk: int) -> None:
    cuts = segments(sizes, chunk)
    covered: dict[int, list[tuple[int, int]]] = {}
    for pieces in cuts:
        at = 0
        for index, a, b, offset in pieces:
            assert offset == at, "pieces fill a chunk from its start, without gaps"
            at += b - a
            covered.setdefault(index, []).append((a, b))
        assert 0 < at <= chunk
    assert all(sum(b - a for _, a, b, _ in pieces) == chunk for pieces in cuts[:-1]), "only the last is short"
    for index, size in enumerate(sizes):
        spans = covered.get(index, [])
        assert sum(b - a for a, b in spans) == size
        assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)), "in order"
    assert len(cuts) == -(-sum(sizes) // chunk)


def test_a_flipped_byte_or_a_short_chunk_is_refused() -> None:
    sealed = seal(b"the state of the model" * 10)
    assert intact(sealed)
    for i in (0, 5, len(sealed) - 20, len(sealed) - 1):  # payload and digest alike
        broken = bytearray(sealed)
        broken[i] ^= 0x01
        assert not intact(bytes(broken))
    assert not intact(sealed[:-1])
    assert not intact(b"short")
