"""The fault runner's pure parts: seeds are reproducible, junit results become the table."""

from __future__ import annotations

from pathlib import Path

from scripts.faults import ROWS, draw_seeds, table, tally

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.faults.test_worker_faults" name="test_sigkill_random_rank_at_random_step[seed=5]"/>
<testcase classname="tests.faults.test_worker_faults" name="test_sigkill_random_rank_at_random_step[seed=9]">
<failure message="boom">boom</failure></testcase>
<testcase classname="tests.faults.test_worker_faults" name="test_enospc_on_a_real_small_tmpfs">
<skipped type="pytest.skip" message="cannot mount a tmpfs here">no mount</skipped></testcase>
<testcase classname="tests.faults.test_real_service" name="test_real_etcd_quorum[seed=5]">
<skipped type="pytest.xfail" message="a job does not come back">x</skipped></testcase>
<testcase classname="r" name="test_kill_during_the_state_transfer[sender-seed=5]"/>
<testcase classname="r" name="test_kill_during_the_state_transfer[receiver-seed=5]"><failure/></testcase>
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
    tmpfs = results["enospc-tmpfs"]
    assert tmpfs.not_run and tmpfs.notes == {"not run: cannot mount a tmpfs here"}
    assert results["bad-path-fields"].failed == [5]
    transfer = results["peer-kill-in-transfer"]  # cases with other parameters next to the seed
    assert (transfer.trials, transfer.passed, transfer.failed) == (2, 1, [5])
    text = table(results, base=7, seconds=12.0)
    assert "| sigkill-rank | 2 | 1 | 9 |" in text and "Base seed 7" in text
    # a row that could not run is never shown as passed, nor is one absent from the results
    assert "| enospc-tmpfs | 0 | NOT RUN | - | not run: cannot mount a tmpfs here |" in text
    assert "| bare-torchrun | 0 | NOT RUN | - |" in text
    # a known defect that failed as expected says so, and is not counted as run-and-passed
    assert "| etcd-quorum-real | 0 | XFAIL 1 | - | known failure: a job does not come back |" in text
    assert f"rows NOT RUN** here: {', '.join(r for r in ROWS if results[r].not_run)}." in text
