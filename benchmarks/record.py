"""A benchmark's result record: the one line a benchmark prints for ``make bench`` to collect, and
the table of ``docs/benchmarks.md`` that ``make bench`` rewrites from the records. Pure, except
:func:`emit` (prints) and :func:`machine` (reads the host).

A benchmark ends with :func:`emit`: its headline measure, the value, the spread of the rounds it
came from and its target. :mod:`benchmarks.run_all` reads the lines that start with
:data:`PREFIX` from each benchmark's output and puts one row per benchmark between
:data:`BEGIN` and :data:`END` in ``docs/benchmarks.md``; the rest of that file is left as it is.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

PREFIX = "ELASTRAIN_BENCH_RESULT "
BEGIN = "<!-- bench-table:begin (written by make bench; edit outside the markers) -->"
END = "<!-- bench-table:end -->"


@dataclass(frozen=True, slots=True)
class Record:
    """A benchmark's headline: ``measure`` (what is divided by what), ``value``, ``spread`` (the
    rounds' median and range, or the interval), ``target`` (e.g. ``>= 0.98``; empty: none)."""

    measure: str
    value: float
    spread: str
    target: str = ""


def spread_of(values: Sequence[float], digits: int = 3) -> str:
    """``min .. max over N rounds`` of per-round values; ``1 round`` when there is one. Pure."""
    if not values:
        return ""
    if len(values) == 1:
        return "1 round"
    return f"{min(values):.{digits}f} .. {max(values):.{digits}f} over {len(values)} rounds"


def emit(
    measure: str, value: float, *, target: str = "", rounds: Sequence[float] = (), spread: str = ""
) -> None:
    """Prints this benchmark's record (one line) for :mod:`benchmarks.run_all`; ``spread`` defaults
    to :func:`spread_of` of ``rounds``."""
    record = Record(measure=measure, value=float(value), spread=spread or spread_of(rounds), target=target)
    print(PREFIX + json.dumps(asdict(record)), flush=True)


def parse(lines: Iterable[str]) -> list[Record]:
    """The records among a benchmark's output lines, in order. Pure."""
    return [Record(**json.loads(line[len(PREFIX) :])) for line in lines if line.startswith(PREFIX)]


def machine() -> str:
    """The host in a few words: cores and CPU model."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model}"


@dataclass(frozen=True, slots=True)
class Row:
    """One benchmark's line in the table: its module, what it compares, its record, when and where
    it was measured (``machine`` says quick mode and a shared machine where they apply)."""

    module: str
    compares: str
    record: Record
    date: str
    machine: str

    def cells(self) -> list[str]:
        r = self.record
        return [f"`{self.module}`", self.compares, r.measure, r.target or "none",
                _num(r.value), r.spread, self.date, self.machine]  # fmt: skip


def _num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3f}"


HEADER = ("Benchmark", "What it compares", "Measure", "Target", "Latest value", "Spread", "Date", "Machine")


def table(rows: Sequence[Row]) -> list[str]:
    """The markdown table of ``rows``, one line each. Pure."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    return lines + ["| " + " | ".join(c.replace("|", "\\|") for c in row.cells()) + " |" for row in rows]


def merge(document: str, rows: Sequence[Row], order: Sequence[str]) -> str:
    """``document`` with its table between :data:`BEGIN` and :data:`END` rewritten: a row for each
    of ``rows``; the rows already there for other benchmarks are kept (a benchmark that did not
    complete keeps its last measured row), ordered as ``order`` (modules). Raises ValueError when
    the markers are missing. Pure."""
    try:
        head, rest = document.split(BEGIN, 1)
        body, tail = rest.split(END, 1)
    except ValueError:
        raise ValueError(f"the document has no {BEGIN!r} ... {END!r} markers") from None
    fresh = {row.module for row in rows}
    old = [line for line in body.strip().splitlines()[2:] if line.startswith("|")]
    kept = [line for line in old if _module(line) not in fresh]
    new = table(rows)
    rank = {module: i for i, module in enumerate(order)}
    body_lines = sorted(kept + new[2:], key=lambda line: (rank.get(_module(line), len(rank)), _module(line)))
    return f"{head}{BEGIN}\n" + "\n".join(new[:2] + body_lines) + f"\n{END}{tail}"


def _module(line: str) -> str:
    return line.strip().strip("|").split("|")[0].strip().strip("`")
