"""Which member's state every other member takes, and the trace checker's rule for versions a
failure superseded."""

from __future__ import annotations

from collections import Counter

import pytest

from worker.recovery.plan import (
    SUMMARY_LEN,
    Diverged,
    NoState,
    Source,
    Summary,
    choose_source,
    committed_records,
    decode_summary,
    encode_summary,
    sample_counts,
    superseded_versions,
)

SPEC = bytes(range(16))
A, B = b"\x01" * 16, b"\x02" * 16


def s(rank: int, version: int = 10, *, state: bool = True, digest: bytes = A, spec: bytes = SPEC,
      window: bool = False, progress: bytes = B) -> Summary:  # fmt: skip
    return Summary(rank, state, version, 4, window, spec, digest, progress)


CASES = [
    ("newest version, lowest rank", [s(0, 9), s(1, 10), s(2, 10), s(3, state=False)],
     Source(1, 10, (0, 3), (1, 2), 0)),
    ("spare receives from rank 0", [s(0), s(1), s(2, state=False)], Source(0, 10, (2,), (0, 1), 0)),
    ("a survivor died after its vote: roll forward", [s(0, 10, window=True), s(1, 11)],
     Source(1, 11, (0,), (1,), 0)),
    ("in-flight window voided", [s(0, 10, window=True), s(1, 10, window=True), s(2, state=False)],
     Source(0, 10, (2,), (0, 1), 1)),
    ("a stale member's version does not count without state", [s(0, 12, state=False), s(1, 10)],
     Source(1, 10, (0,), (1,), 0)),
    ("digest divergence at the top", [s(0), s(1, digest=B)], Diverged((0, 1), "")),
    ("progress divergence at the top", [s(0), s(1, progress=A)], Diverged((0, 1), "")),
    ("divergence below the top does not matter", [s(0, 9, digest=B), s(1, 10), s(2, 10)],
     Source(1, 10, (0,), (1, 2), 0)),
    ("another spec", [s(0), s(1), s(2, spec=B)], Diverged((2,), "")),
    ("nobody holds state: storage", [s(0, state=False), s(1, state=False)], NoState("")),
]  # fmt: skip


@pytest.mark.parametrize(("name", "summaries", "expected"), CASES, ids=[c[0] for c in CASES])
def test_choose_source(name: str, summaries: list[Summary], expected: object) -> None:
    got = choose_source(list(reversed(summaries)))  # order of arrival does not matter
    assert type(got) is type(expected)
    if isinstance(expected, Source):
        assert got == expected
    if isinstance(expected, Diverged):
        assert isinstance(got, Diverged) and got.ranks == expected.ranks and got.reason
    if isinstance(got, NoState):
        assert got.reason


def test_summary_round_trip() -> None:
    original = s(5, 1234, window=True, digest=bytes(range(100, 116)), progress=b"\xff" * 16)
    words = encode_summary(original)
    assert len(words) == SUMMARY_LEN
    assert all(-(1 << 63) <= w < 1 << 63 for w in words)  # fits an int64 tensor
    assert decode_summary(5, words) == original
    with pytest.raises(ValueError, match="summary"):
        decode_summary(0, words[:-1])


def rec(generation: int, version: int, indices: list[int], epoch: int = 0) -> dict[str, object]:
    return {"generation": generation, "version": version, "epoch": epoch, "indices": indices}


def test_trace_rule_keeps_the_newest_generation_of_each_version() -> None:
    rows = [
        rec(0, 0, [0, 1]), rec(0, 0, [2, 3]),
        rec(0, 1, [4, 5]),  # version 1 committed only by the member that died (its trace line)...
        rec(1, 1, [4, 5]), rec(1, 1, [6, 7]),  # ...and retrained by generation 1 at the new world size
        rec(1, 2, [8, 9]), rec(1, 2, [6, 7], epoch=1),
    ]  # fmt: skip
    assert superseded_versions(rows) == {1}
    kept = committed_records(rows)
    assert rec(0, 1, [4, 5]) not in kept and len(kept) == 6
    counts = sample_counts(rows)
    assert counts == Counter({(0, i): 1 for i in range(10)} | {(1, 6): 1, (1, 7): 1})


def test_trace_rule_sees_a_sample_twice() -> None:
    rows = [rec(0, 0, [0, 1]), rec(0, 1, [1, 2])]
    assert sample_counts(rows)[(0, 1)] == 2
    assert superseded_versions(rows) == set()
