"""Which rank is a straggler, from the compute times the ranks share once per window (pure).

Every ``window_steps`` steps each rank puts its median step's compute seconds over the window
(see :mod:`worker.train.straggler_watch` for what is measured) and its node's number into its own
slots of a vector of ``2 W`` numbers (:func:`ballot`); the step's all-reduce (a sum) brings every
rank the whole vector (:func:`unpack`). A rank's slowdown is its time over the median of the
other ranks' times (:func:`slowdowns`): with two ranks the median of the pair would halve any
difference, so each rank is compared with the rest of the group. A rank slower than
``slowdown`` in ``windows`` consecutive windows is named (:func:`judge`), once per spell: it is
named again only after as many normal windows in a row cleared it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


def ballot(
    *, rank: int, world_size: int, seconds_per_step: float, node: int, spares: int | None = None
) -> tuple[float, ...]:
    """This rank's part of the window's vector: its time at ``rank``, ``node + 1`` at
    ``world_size + rank`` (0 elsewhere: the sum over the ranks holds every rank's numbers).
    A rank that measured nothing this window (it joined mid-window) sends a time of 0.
    ``spares`` (``stragglers.action: replace`` only): one number more, the warm spares waiting
    as the group's leader counts them (every other rank sends 0 there)."""
    values = [0.0] * (2 * world_size + (spares is not None))
    values[rank] = max(float(seconds_per_step), 0.0)
    values[world_size + rank] = float(node + 1)
    if spares is not None:
        values[-1] = float(spares)
    return tuple(values)


def unpack(summed: Sequence[float], world_size: int) -> tuple[list[float], list[int | None], int]:
    """(each rank's seconds per step, each rank's node or None, the spares waiting: 0 when the
    vector does not carry them) from the summed vector."""
    times = [float(v) for v in summed[:world_size]]
    nodes = [round(v) - 1 if v >= 1 else None for v in summed[world_size : 2 * world_size]]
    spares = round(summed[2 * world_size]) if len(summed) > 2 * world_size else 0
    return times, nodes, spares


def slowdowns(times: Sequence[float]) -> list[float | None]:
    """Each rank's time over the median of the other ranks' measured times; None for a rank
    that measured nothing, or when no other rank did."""
    out: list[float | None] = []
    for rank, mine in enumerate(times):
        others = [t for r, t in enumerate(times) if r != rank and t > 0]
        out.append(mine / statistics.median(others) if mine > 0 and others else None)
    return out


@dataclass(frozen=True, slots=True)
class Streaks:
    """Per rank: where its current streak of slow windows began and how long it is; the ranks
    named, and how many normal windows each named rank has had in a row since."""

    slow_since: Mapping[int, int] = field(default_factory=dict)
    """rank -> the first step of its current streak of slow windows."""
    count: Mapping[int, int] = field(default_factory=dict)
    named: Mapping[int, int] = field(default_factory=dict)
    """A named rank -> its normal windows in a row (it is cleared after ``windows`` of them)."""


@dataclass(frozen=True, slots=True)
class Named:
    """A straggler: ``rank`` was slower than the threshold in ``windows`` consecutive windows,
    from ``first_step`` to ``step``; ``slowdown`` is the newest window's."""

    rank: int
    slowdown: float
    first_step: int
    step: int
    windows: int


def judge(
    streaks: Streaks,
    ratios: Sequence[float | None],
    *,
    step: int,
    window_steps: int,
    threshold: float,
    windows: int,
) -> tuple[Streaks, list[Named]]:
    """Fold one window (ending at ``step``) into the streaks; the ranks it names. A rank is
    named once per spell of slowness: a named rank is named again only after ``windows`` normal
    windows in a row cleared it. A rank without a ratio this window (nothing measured) keeps
    its streaks as they were."""
    since, count, named = dict(streaks.slow_since), dict(streaks.count), dict(streaks.named)
    found: list[Named] = []
    for rank, ratio in enumerate(ratios):
        if ratio is None:
            continue
        if ratio <= threshold:
            since.pop(rank, None)
            count.pop(rank, None)
            if rank in named:
                named[rank] += 1
                if named[rank] >= windows:
                    del named[rank]
            continue
        since.setdefault(rank, step - window_steps + 1)
        count[rank] = count.get(rank, 0) + 1
        if rank in named:
            named[rank] = 0
        elif count[rank] >= windows:
            named[rank] = 0
            found.append(Named(rank, ratio, since[rank], step, count[rank]))
    return Streaks(since, count, named), found


def still_slow(
    streaks: Streaks, ratios: Sequence[float | None], found: Sequence[Named], *, step: int, threshold: float
) -> list[Named]:
    """The ranks named in an earlier window that were slower than ``threshold`` again in this one
    (``streaks`` as :func:`judge` left them; ``found``, the ranks it named now, are not among
    them): a straggler kept because no spare waited is one again when a spare comes. Pure."""
    now = {n.rank for n in found}
    return [
        Named(rank, float(ratio), streaks.slow_since[rank], step, streaks.count[rank])
        for rank, ratio in enumerate(ratios)
        if rank not in now and streaks.named.get(rank) == 0 and ratio is not None and ratio > threshold
        and rank in streaks.slow_since
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Replacement:
    """What ``stragglers.action: replace`` does about a named rank: whether its node leaves,
    which ranks leave with it (every rank of that node), and why, in words for the event."""

    leave: bool
    node: int | None
    ranks: tuple[int, ...]
    why: str


def replacement(named: Named, nodes: Sequence[int | None], *, spares: int, min_world: int) -> Replacement:
    """Whether the named rank's node leaves the group (every rank computes the same from the
    window's sums). It leaves when a warm spare waits to take its place, or when the ranks left
    are still at least ``min_world`` (the job's smallest ``nodes`` x ``nproc_per_node``: the
    group goes on smaller until a new node joins); otherwise it stays and is only reported. Pure."""
    node = nodes[named.rank] if named.rank < len(nodes) else None
    if node is None:
        return Replacement(False, None, (), "its node is not known")
    ranks = tuple(r for r, n in enumerate(nodes) if n == node)
    left = len(nodes) - len(ranks)
    if left < 1:
        return Replacement(False, node, ranks, "every rank of the group is on that node")
    if spares > 0:
        return Replacement(True, node, ranks, f"a warm spare takes its place ({spares} waiting)")
    if left >= min_world:
        return Replacement(
            True, node, ranks, f"no spare waits: the group goes on with {left} ranks until a new node joins"
        )
    return Replacement(
        False, node, ranks,
        f"no spare waits, and without its {len(ranks)} rank(s) the group would have {left}, below "
        f"the {min_world} its smallest 'nodes' needs",
    )  # fmt: skip


def slowest(found: Sequence[Named]) -> Named | None:
    """The one named rank whose node may be replaced this window: the slowest (one node leaves at
    a time; the others stay named). Pure."""
    return max(found, key=lambda n: n.slowdown, default=None)
