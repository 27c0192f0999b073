"""The fault runner's pure parts: seeds are reproducible, junit results become the table."""

from __future__ import annotations

from pathlib import Path

from scripts.faults import ROWS, draw_seeds, table, tally

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.faults.test_worker_faults" name="test_sigkill_random_rank_at_random_step[seed=5]"/>
<testcase classname="tests.faults.test_worker_faults" name="test_sigkill_random_rank_at_random_step[seed=9]">
<failure message="boom">boom</failure></testcase>
<testcase classname="tests.faults.test_sigstop" name="test_sigstop_past_the_collective_timeout[seed=5]">
<skipped type="pytest.skip" message="slow row: set ELASTRAIN_FAULTS_SLOW=1">slow</skipped></testcase>
<testcase classname="tests.faults.test_bad_input" name="test_traversal_paths_are_422[seed=5]">
<error message="fixture">x</error></testcase>
</testsuite></testsuites>"""


def test_seeds_are_reproducible_and_distinct() -> None:
    assert draw_seeds(7, 5) == draw_seeds(7, 5)
    assert len(set(draw_seeds(7, 50))) == 50


def test_junit_becomes_rows_with_failed_seeds(tmp_path: Path) -> None:
    junit = tmp_path / "j.xml"
    junit.write_text(JUNIT)
    results = tally(junit, ROWS)
    kill = results["sigkill-rank"]
    assert (kill.trials, kill.passed, kill.failed) == (2, 1, [9])
    slow = results["sigstop-worker-past-timeout"]
    assert slow.trials == 0 and any("ELASTRAIN_FAULTS_SLOW" in n for n in slow.notes)
    assert results["bad-path-fields"].failed == [5]
    text = table(results, base=7, seconds=12.0)
    assert "| sigkill-rank | 2 | 1 | 9 |" in text and "Base seed 7" in text
