"""`make test` runs each test once: the tree's run (`scripts.test_installed --rest`) and the run
against the installed wheel (`SUBSET`) split the suite between them."""

from __future__ import annotations

from pathlib import Path

from scripts.test_installed import SOURCE_TESTS, SUBSET, rest

TESTS = Path(__file__).resolve().parents[1]


def test_every_top_level_test_directory_runs_in_one_of_the_two_runs() -> None:
    """All but tests/gpu, which needs a GPU (`make test-gpu`)."""
    args = rest(TESTS)
    tops = {f"tests/{d.name}" for d in TESTS.iterdir() if d.is_dir() and d.name != "__pycache__"}
    in_rest = {a for a in args if not a.startswith("--") and a.count("/") == 1}
    assert in_rest | {"tests/unit", "tests/gpu"} == tops
    assert "tests/gpu" not in in_rest
    assert "tests/unit" in SUBSET and "tests/unit" not in in_rest


def test_the_source_tree_tests_run_from_the_tree_and_the_subsets_integration_tests_do_not() -> None:
    args = rest(TESTS)
    assert set(SOURCE_TESTS) <= set(args)
    deselected = {a.removeprefix("--deselect=") for a in args if a.startswith("--deselect=")}
    assert deselected == {node for node in SUBSET if not node.startswith("tests/unit")}
    assert all((TESTS.parent / node.split("::")[0]).is_file() for node in deselected)
