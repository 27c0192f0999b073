"""The commit vote: what rides on the all-reduce every window already pays for.

Every window ends with one SUM all-reduce of a small float64 vector
(:func:`worker.train.step.optimizer_step`: the non-finite flag, the loss, the save votes). Peer
recovery makes that reduction the window's commit point. A member's ballot is::

    [ reform ]                                                        (most windows)
    [ reform,  g_0 + 1, v_0 + 1,  g_1 + 1, v_1 + 1,  ...,  g_{W-1} + 1, v_{W-1} + 1 ]
                                                         (the stamps: see :func:`stamps_due`)

``reform`` (1 for the leader asking for a planned re-formation, when joiners wait) is *added to
the step's non-finite flag* (element 0: 0, or NaN when any member's gradient is not finite), so
that the common window sends no number more than restart mode's. Summed, element 0 is the count
of members asking, or NaN: a non-finite window loses the request, which the leader makes again
the next window (a skipped window re-forms nothing either way). The stamps, when due, are
appended: member ``r`` fills only its own pair, ``(generation + 1, version + 1)``, and zeros
elsewhere, so each pair has exactly one contributor and the sum hands every member every
member's (generation, version), exactly (float64 holds integers to 2**53; generation < 2**29,
version < 2**32). A pair nobody filled reads ``(-1, -1)``.

Every member computes its verdict from the same summed values, so all agree: any pair different
from this member's own raises :class:`Fenced` on *every* member (the one ahead included);
otherwise the verdict is the step's flag and ``reform > 0``.

Why the stamps are not in every window: on this machine's gloo the step's all-reduce costs by the
count of its numbers (2 processes: 7 float64 took 11-17% longer than 2 after ~5 ms of compute,
``benchmarks/allreduce_length.py``), and the five numbers of a W=2 ballot cost peer mode ~2% of
its throughput (``benchmarks/peer_steady.py --keep commit``). A generation's members agree on
their state by digest when it forms (:mod:`worker.recovery.handover`) and apply every window or
none, and a member of another generation cannot take part in this generation's collectives (its
group lives under another store prefix; the hub fences it at once), so the stamps check what the
formation already agreed. They are checked where that agreement was made -- a generation's first
window, which also catches two members holding the same rank -- and every :data:`STAMPS_EVERY`
windows after, as a guard. Which windows carry them is counted in windows of the generation, not
from the version the stamps check, so the members never disagree on the vector's length.

The vote rides on the step's own reduction rather than as a collective of its own: on gloo a
small all-reduce costs by the count of its numbers, and a second collective costs more than a few
numbers added to the first (``benchmarks/allreduce_length.py``, ``benchmarks/vote_carrier.py``).

The rule the callers keep: no collective between the vote and the end of the apply (scaler
update, clip, ``optimizer.step``, cursor and version advance). A member applies the window only
after :func:`check` returned.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GENERATION_BITS = 29
VERSION_BITS = 32
STAMPS_EVERY = 64
"""The stamps ride on a generation's first window and on every 64th after it."""


class Fenced(RuntimeError):
    """This member's (generation, version) is not the group's: it must not apply the window.

    Raised on every member of a group whose stamps disagree; the group breaks and re-forms, and a
    member that holds an older generation than the group's record is fenced out (its state
    invalid)."""

    def __init__(self, mine: tuple[int, int], seen: Sequence[tuple[int, int]]) -> None:
        others = sorted({s for s in seen if s != mine})
        super().__init__(
            f"fenced: this member is at {describe(mine)}, the group also holds "
            f"{', '.join(describe(s) for s in others)}"
        )
        self.mine, self.seen = mine, tuple(seen)


class NotCommitted(RuntimeError):
    """The leader announced this generation but etcd does not hold it (a join writes its record
    while the group forms: :mod:`worker.recovery.joincommit`). Raised on the leader before its part
    of the generation's first vote, so that no member applies a window in it; the group breaks
    and re-forms from what etcd holds. The message says why."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the reduced vote says, identically on every member."""

    nonfinite: bool
    reform: bool


def describe(stamp: tuple[int, int]) -> str:
    generation, version = stamp
    return "no member (an empty slot)" if stamp == (-1, -1) else f"g{generation}/v{version}"


def _valid(generation: int, version: int) -> None:
    if not 0 <= generation < 1 << GENERATION_BITS:
        raise ValueError(f"generation {generation} is outside 0 .. 2**{GENERATION_BITS} - 1")
    if not 0 <= version < 1 << VERSION_BITS:
        raise ValueError(f"version {version} is outside 0 .. 2**{VERSION_BITS} - 1")


def stamps_due(window: int) -> bool:
    """Whether the ``window``-th window of a generation (0: its first) carries the stamps. Pure."""
    return window % STAMPS_EVERY == 0


def request(*, reform: bool) -> list[float]:
    """This member's part of a vote without the stamps (element 0, added to the step's flag)."""
    return [1.0 if reform else 0.0]


def contribution(*, reform: bool, generation: int, version: int, rank: int, world_size: int) -> list[float]:
    """This member's part of a vote with the stamps (``1 + 2 * world_size`` numbers, summed over
    the group; element 0 as in :func:`request`)."""
    _valid(generation, version)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside 0 .. {world_size - 1}")
    values = [0.0] * (1 + 2 * world_size)
    values[0] = request(reform=reform)[0]
    values[1 + 2 * rank], values[2 + 2 * rank] = float(generation + 1), float(version + 1)
    return values


def stamps(summed: Sequence[float], world_size: int) -> list[tuple[int, int]]:
    """Every member's (generation, version) from a summed vote, in rank order."""
    return [(int(summed[1 + 2 * r]) - 1, int(summed[2 + 2 * r]) - 1) for r in range(world_size)]


def check(summed: Sequence[float], *, nonfinite: bool, generation: int, version: int) -> Verdict:
    """The verdict of a summed vote, element 0 being the summed flag and requests (NaN when
    ``nonfinite``, the step's reading of it), or :class:`Fenced` when the vote carries stamps and
    any member's differs from this member's."""
    world_size = (len(summed) - 1) // 2
    if world_size and list(summed[1:]) != [float(generation + 1), float(version + 1)] * world_size:
        raise Fenced((generation, version), stamps(summed, world_size))
    return Verdict(nonfinite=nonfinite, reform=summed[0] > 0)  # NaN > 0 is False


def reduce_sum(votes: list[list[float]]) -> list[float]:
    """What ``all_reduce(SUM)`` of these votes gives (for tests and for reasoning)."""
    return [math.fsum(column) for column in zip(*votes, strict=True)]


def reduce_alone(
    *, nonfinite: bool, ballot: Sequence[float], device: str = "cpu"
) -> tuple[bool, list[float]]:
    """The vote as its own all-reduce over the default group, for a caller without a step
    reduction to ride on (the recovery tests' driver): ``ballot`` (:func:`contribution`) with the
    non-finite flag (NaN) added to its element 0, as the step adds it. Returns the group's flag and
    the summed ballots; raises the collective's own error when a member is gone."""
    import torch
    import torch.distributed as dist

    flag = (math.nan if nonfinite else 0.0) + ballot[0]
    tensor = torch.tensor([flag, *ballot[1:]], dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    values = [float(v) for v in tensor.tolist()]
    return not math.isfinite(values[0]), values
