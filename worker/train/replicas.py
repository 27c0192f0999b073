"""Whether data-parallel replicas agree, and who does not (pure, torch-free).

Every rank of a DDP group holds the same parameters and optimizer state, bit for bit; the ranks
compare digests of it (:mod:`worker.train.integrity`). This module decides from the digests they
gathered: which ranks disagree with the majority (with no strict majority, every rank: with two
replicas neither can be trusted over the other), which tensors differ, and which part of the
state a check covers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

PARTS = 4
"""A periodic check hashes one of this many parts of the state, in turn: all of it every
``PARTS`` checks (a check before a save hashes all of it)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """``ranks``: those whose digest differs from the majority's; every rank when no digest is
    held by more than half of them. Empty: the replicas agree."""

    ranks: tuple[int, ...]

    @property
    def agree(self) -> bool:
        return not self.ranks


def compare(digests: Sequence[Hashable]) -> Verdict:
    """The verdict on one digest per rank (index = rank)."""
    if not digests:
        return Verdict(())
    value, held = Counter(digests).most_common(1)[0]
    if held == len(digests):
        return Verdict(())
    if 2 * held > len(digests):
        return Verdict(tuple(r for r, d in enumerate(digests) if d != value))
    return Verdict(tuple(range(len(digests))))


def differing(names: Sequence[str], per_rank: Sequence[Sequence[Hashable]]) -> list[str]:
    """The names of the tensors whose digests (``per_rank[rank][i]`` for ``names[i]``) are not
    the same on every rank, in ``names``' order."""
    return [name for i, name in enumerate(names) if not compare([d[i] for d in per_rank]).agree]


def split(sizes: Sequence[int], parts: int = PARTS) -> list[list[int]]:
    """The tensors' indices in at most ``parts`` parts of about equal bytes (``sizes``): the
    largest first, each into the lightest part so far (ties: the lower part); each part in
    index order, empty parts left out. The same sizes give the same parts on every rank."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(parts), key=lambda k: (loads[k], k))
        loads[k] += sizes[i]
        out[k].append(i)
    return [sorted(p) for p in out if p]


def part_at(step: int, every_steps: int, parts: int) -> int:
    """Which part the periodic check at ``step`` hashes: the next one each check, the same on
    every rank and after a restart."""
    return (step // every_steps) % parts


def due(step: int, every_steps: int) -> bool:
    """Whether a periodic check follows ``step``."""
    return step > 0 and step % every_steps == 0


def describe(step: int, ranks: Sequence[int], tensors: Sequence[str], world_size: int) -> str:
    """One line for people: the step, who disagrees, and what differs."""
    who = "both ranks" if world_size == 2 and len(ranks) == 2 else "ranks " + ", ".join(map(str, ranks))
    if len(ranks) == world_size and world_size > 2:
        who = f"all {world_size} ranks (no majority)"
    shown = ", ".join(tensors[:8]) + (f" and {len(tensors) - 8} more" if len(tensors) > 8 else "")
    return f"data-parallel replicas disagree after step {step}: {who}, in {shown or 'the state digest'}"
