"""What the benchmarks compute from their rounds: the spread they print, the order of the arms in
a round, and the interval that says whether a ratio's target is met. Pure."""

from __future__ import annotations

import math
import random
import statistics


def spread(values: list[float], digits: int = 2, *, grouping: bool = False) -> str:
    """The median and the range, for a benchmark's printout. Pure."""
    f = f"{',' if grouping else ''}.{digits}f"
    m, lo, hi = statistics.median(values), min(values), max(values)
    return f"median {m:{f}} (min {lo:{f}}, max {hi:{f}})"


def geomean_interval(
    ratios: list[float], *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> tuple[float, float, float]:
    """The geometric mean of per-round ratios and its percentile bootstrap interval (the rounds
    resampled with replacement; seeded, so a run's printout is reproducible from its numbers).
    The geometric mean: a ratio and its inverse weigh alike. Pure."""
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"ratios must be positive and at least one: {ratios}")
    logs = [math.log(r) for r in ratios]
    draw = random.Random(seed)
    means = sorted(statistics.fmean(draw.choices(logs, k=len(logs))) for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    lo = means[min(len(means) - 1, int(tail * len(means)))]
    hi = means[min(len(means) - 1, int((1.0 - tail) * len(means)))]
    return math.exp(statistics.fmean(logs)), math.exp(lo), math.exp(hi)


def verdict(interval: tuple[float, float, float], target: float, *, at_most: bool = False) -> str:
    """Whether an interval (mean, low, high) meets a lower bound ``target`` (``at_most``: an
    upper bound). Pure."""
    _, lo, hi = interval
    if (hi <= target) if at_most else (lo >= target):
        return "met"
    if (lo > target) if at_most else (hi < target):
        return "missed"
    return f"not settled by this run (the interval holds {target})"


def rotation(arms: tuple[str, ...], i: int) -> tuple[str, ...]:
    """Round ``i``'s order of the arms: each arm goes first, second, ... in turn. Pure."""
    k = i % len(arms)
    return arms[k:] + arms[:k]


def block_arm(arms: tuple[str, ...], step: int, *, block: int, warm: int) -> tuple[str, int] | None:
    """In one job whose windows of ``block`` steps take the arms in turn (each cycle in the
    order :func:`rotation` gives it): the arm and cycle of the window that trains ``step`` + 1;
    None before ``warm``. Pure."""
    if step < warm:
        return None
    cycle, k = divmod((step - warm) // block, len(arms))
    return rotation(arms, cycle)[k], cycle
