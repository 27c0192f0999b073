"""The commit vote: the one all-reduce a window already pays for, packed as two int64.

Every window ends with an ``all_reduce(MAX)`` of a non-finite-gradient flag (today's
:func:`worker.amp.any_rank_non_finite`). Peer recovery makes that reduction the window's commit
point and widens it, for free (E10: two int64 cost what one float32 costs; three or more elements
take gloo's full ring at W >= 3), to::

    [ (STAMP_LIMIT - 1 - stamp) << 2 | flags ,  stamp ]      stamp = generation << 32 | version

reduced with MAX. ``flags`` is ``nonfinite << 1 | reform``. Element 1 gives the highest stamp of
the group, element 0 the lowest (its high bits are the stamp inverted), so *every* member sees a
member from another generation or at another version, including the one ahead: the design's
``[flags, stamp]`` let the member ahead apply the window while the others refused it (a deviation
from issue14-design.md §3.3, same cost). When the stamps agree, element 0's low bits are the
MAX of every member's flags: ``nonfinite`` (bit 1) is never lost; ``reform`` (bit 0) reads
``max & 1``, which every member computes from the same value, so a request hidden by a
non-finite member (2 > 1) is hidden from all alike and the leader asks again next window.

The rule the callers keep: no collective between the vote and the end of the apply (scaler
update, clip, ``optimizer.step``, cursor and version advance). A member applies the window only
after :func:`check` returned.
"""

from __future__ import annotations

from dataclasses import dataclass

NONFINITE = 2
REFORM = 1
GENERATION_BITS = 29  # 2**29 generations; the stamp stays below 2**61 so that << 2 fits an int64
VERSION_BITS = 32
STAMP_LIMIT = 1 << (GENERATION_BITS + VERSION_BITS)


class Fenced(RuntimeError):
    """This member's (generation, version) is not the group's: it must not apply the window.

    Raised on every member of a group whose stamps disagree; the group breaks and re-forms, and a
    member that holds an older generation than the group's record is fenced out (its state
    invalid)."""

    def __init__(self, mine: int, low: int, high: int) -> None:
        g, v = split_stamp(mine)
        super().__init__(
            f"fenced: this member is at generation {g} version {v}, the group holds stamps "
            f"{describe_stamp(low)} .. {describe_stamp(high)}"
        )
        self.mine, self.low, self.high = mine, low, high


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the reduced vote says, identically on every member."""

    nonfinite: bool
    reform: bool


def stamp(generation: int, version: int) -> int:
    """``generation << 32 | version``; refuses values that do not fit."""
    if not 0 <= generation < 1 << GENERATION_BITS:
        raise ValueError(f"generation {generation} is outside 0 .. 2**{GENERATION_BITS} - 1")
    if not 0 <= version < 1 << VERSION_BITS:
        raise ValueError(f"version {version} is outside 0 .. 2**{VERSION_BITS} - 1")
    return generation << VERSION_BITS | version


def split_stamp(value: int) -> tuple[int, int]:
    return value >> VERSION_BITS, value & ((1 << VERSION_BITS) - 1)


def describe_stamp(value: int) -> str:
    g, v = split_stamp(value)
    return f"g{g}/v{v}"


def pack(*, nonfinite: bool, reform: bool, generation: int, version: int) -> tuple[int, int]:
    """This member's two vote elements."""
    s = stamp(generation, version)
    flags = (NONFINITE if nonfinite else 0) | (REFORM if reform else 0)
    return (STAMP_LIMIT - 1 - s) << 2 | flags, s


def unpack(reduced: tuple[int, int]) -> tuple[int, int, int]:
    """``(flags, lowest stamp, highest stamp)`` of a MAX-reduced vote."""
    first, high = reduced
    return first & 3, STAMP_LIMIT - 1 - (first >> 2), high


def check(reduced: tuple[int, int], mine: tuple[int, int]) -> Verdict:
    """The verdict of a reduced vote, or :class:`Fenced` when any member's stamp differs."""
    flags, low, high = unpack(reduced)
    own = mine[1]
    if low != own or high != own:
        raise Fenced(own, low, high)
    return Verdict(nonfinite=bool(flags & NONFINITE), reform=bool(flags & REFORM))


def reduce_max(votes: list[tuple[int, int]]) -> tuple[int, int]:
    """What ``all_reduce(MAX)`` of these votes gives (for tests and for reasoning)."""
    return max(v[0] for v in votes), max(v[1] for v in votes)


def commit_vote(
    *, nonfinite: bool, reform: bool, generation: int, version: int, device: str = "cpu"
) -> Verdict:
    """Reduce this member's vote over the default group and check it (the one tensor helper).

    Raises :class:`Fenced`, or the collective's own error when a member is gone."""
    import torch
    import torch.distributed as dist

    mine = pack(nonfinite=nonfinite, reform=reform, generation=generation, version=version)
    tensor = torch.tensor(mine, dtype=torch.int64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    values = tensor.tolist()
    return check((int(values[0]), int(values[1])), mine)
