"""A team's factory by ``module:function``: a failure to find it is one line saying what was
looked for, where (the working directory, PYTHONPATH; the job's env.PYTHONPATH under the
service), and the fix, and tells a missing module from a module whose own import fails and from
a module without the callable."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.errors import SpecError
from worker.start.usercode import load_factory, not_found, places

MODEL = """
from torch import nn


def build_model(meta):
    return nn.Linear(2, 2)


class Head(nn.Module):
    pass


SIZES = {"d_model": 8}
"""


@pytest.fixture
def team(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A team's directory holding ``team_models.py``, the working directory, as torchrun -m
    puts it first on the import path; its modules are forgotten after the test."""
    (tmp_path / "team_models.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    for name in ("ELASTRAIN_JOB_ID", "ELASTRAIN_SERVICE_URL"):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def refusal(path: str, field: str = "model.factory") -> str:
    with pytest.raises(SpecError) as info:
        load_factory(path, field)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_the_factory_is_found_in_the_working_directory(team: Path) -> None:
    assert load_factory("team_models:build_model", "model.factory").__name__ == "build_model"


def test_a_mistyped_module_says_where_it_was_looked_for_and_the_name_that_is_there(team: Path) -> None:
    line = refusal("team_modles:build_model")
    assert line.startswith(
        f"field 'model.factory': no module 'team_modles' (for 'team_modles:build_model') in the "
        f"working directory {team}, nor among the installed packages (a close name there: 'team_models'); "
    ), line
    assert line.endswith("start torchrun in the directory holding it, or put that directory on PYTHONPATH")


def test_under_the_service_the_fix_is_the_jobs_env_pythonpath(
    team: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path_factory.mktemp("code")
    monkeypatch.setenv("PYTHONPATH", str(elsewhere))
    monkeypatch.setenv("ELASTRAIN_JOB_ID", "j")
    monkeypatch.setenv("ELASTRAIN_SERVICE_URL", "http://127.0.0.1:1")
    line = refusal("nowhere_models:build", "data.factory")
    assert f"in the working directory {team}, PYTHONPATH {elsewhere}, nor among" in line, line
    assert line.endswith("set the job's env.PYTHONPATH to the directory holding it, as the nodes see it")


def test_a_module_given_as_its_file_name_is_told_to_drop_py(team: Path) -> None:
    line = refusal("team_models.py:build_model")
    assert line.endswith("give the module without .py ('team_models:build_model')"), line


def test_a_module_whose_import_fails_shows_its_error_and_line(team: Path) -> None:
    (team / "needs_more.py").write_text("import os\nimport transformerz\n")
    (team / "typo_inside.py").write_text("x = 1\ny = undefined_name\n")
    line = refusal("needs_more:build")
    assert line == (
        f"field 'model.factory': module 'needs_more' was found, but importing it failed at "
        f"{team / 'needs_more.py'}:2: ModuleNotFoundError: No module named 'transformerz'; "
        "install it where the workers run, or fix the import"
    )
    line = refusal("typo_inside:build")
    assert f"at {team / 'typo_inside.py'}:2: NameError: name 'undefined_name' is not defined" in line


def test_a_missing_callable_lists_what_the_module_defines(team: Path) -> None:
    line = refusal("team_models:build")
    assert line == (
        f"field 'model.factory': module 'team_models' ({team / 'team_models.py'}) has no callable "
        "'build' (a close name: 'build_model'); it defines Head, build_model"
    )  # nn, imported there, is not listed
    assert "is a dict, not a function or class" in refusal("team_models:SIZES")


def test_the_places_are_the_working_directory_on_the_path_and_pythonpath() -> None:
    env = {"PYTHONPATH": "/code:/more:"}
    assert places(["", "/usr/lib/python3"], env, "/home/t") == [
        ("the working directory", "/home/t"), ("PYTHONPATH", "/code"), ("PYTHONPATH", "/more"),
    ]  # fmt: skip
    assert places(["/usr/lib/python3"], {}, "/home/t") == []  # a script's run: not on the path
    line = not_found("loss.factory", "m:f", "m", places=[], near=[], under_service=False)
    assert "no module 'm' (for 'm:f') in neither the working directory nor PYTHONPATH" in line
