"""``make bench`` collects each benchmark's result record from its output and rewrites
docs/benchmarks.md's table from them: one row per benchmark, a failed benchmark's last row kept,
the text outside the markers untouched."""

from __future__ import annotations

import pytest

from benchmarks.record import BEGIN, END, PREFIX, Record, Row, merge, parse, spread_of
from benchmarks.run_all import BENCHMARKS, TABLE


def row(module: str, value: float, date: str = "2026-01-02") -> Row:
    record = Record("a / b", value, "0.9 .. 1.1 over 3 rounds", ">= 0.98")
    return Row(module, f"what {module} compares", record, date, "2 cores, quick mode")


def test_records_are_found_among_a_benchmarks_lines() -> None:
    line = PREFIX + '{"measure": "a / b", "value": 0.5, "spread": "1 round", "target": ""}'
    assert parse(["round 1: 0.4", line, "done"]) == [Record("a / b", 0.5, "1 round", "")]
    assert parse(["no record here"]) == []


def test_the_spread_of_rounds() -> None:
    assert spread_of([1.0, 0.5, 0.75]) == "0.500 .. 1.000 over 3 rounds"
    assert spread_of([0.9]) == "1 round"
    assert spread_of([]) == ""


def test_merge_writes_one_row_per_benchmark_and_keeps_the_rest_of_the_page() -> None:
    page = f"# Benchmarks\n\nintro\n\n{BEGIN}\n{END}\n\nafter\n"
    order = ["benchmarks.a", "benchmarks.b"]
    first = merge(page, [row("benchmarks.b", 1.5), row("benchmarks.a", 0.25)], order)
    assert first.startswith("# Benchmarks\n\nintro\n\n") and first.endswith("\n\nafter\n")
    body = first.split(BEGIN)[1].split(END)[0].strip().splitlines()
    assert len(body) == 4 and "`benchmarks.a`" in body[2] and "`benchmarks.b`" in body[3]
    assert "0.250" in body[2] and "1.500" in body[3]
    # b ran again, a did not complete: a keeps its last row, b's is replaced, nothing doubles
    second = merge(first, [row("benchmarks.b", 2.0, "2026-02-03")], order)
    body = second.split(BEGIN)[1].split(END)[0].strip().splitlines()
    assert len(body) == 4 and "0.250" in body[2] and "2.000" in body[3] and "2026-02-03" in body[3]


def test_a_page_without_markers_is_refused() -> None:
    with pytest.raises(ValueError, match="markers"):
        merge("# no table\n", [row("benchmarks.a", 1.0)], ["benchmarks.a"])


def test_the_docs_have_one_row_per_benchmark_that_make_bench_runs() -> None:
    text = TABLE.read_text(encoding="utf-8")
    body = text.split(BEGIN)[1].split(END)[0].strip().splitlines()[2:]
    listed = [line.split("|")[1].strip().strip("`") for line in body]
    assert sorted(listed) == sorted(b.module for b in BENCHMARKS)
