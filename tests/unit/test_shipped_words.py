"""What ships speaks of the product, not of how it was built: no "stop N", "this stop", "the stop
before" or "issue N" in the code, comments, docstrings, tests, docs, the chart, the deploy files,
the benchmarks and scripts, nor in the OpenAPI schema that the service publishes (its
descriptions come from the pydantic models' and routes' docstrings). A sentence that needs one
should say what the unit does and why instead; measurements belong in docs/benchmarks.md and the
benchmarks' docstrings."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("service", "worker", "helm", "deploy", "docs", "benchmarks", "scripts", "tests")
FILES = ("README.md", "Makefile", "pyproject.toml")
TEXT = {".py", ".md", ".yaml", ".yml", ".json", ".tpl", ".txt", ".toml", ".cfg", ".ini", ".sh", ".j2", ""}
HISTORY = re.compile(r"\bstops? \d+|\bthis stop\b|\bthe stop before\b|\bissues? #?\d+", re.IGNORECASE)


def history(text: str) -> Iterator[tuple[int, str]]:
    """(line number, the words) of each reference to the project's history in ``text``. Pure."""
    for number, line in enumerate(text.splitlines(), 1):
        for match in HISTORY.finditer(line):
            yield number, match.group(0)


def shipped_files() -> Iterator[Path]:
    for name in FILES:
        if (ROOT / name).is_file():
            yield ROOT / name
    for top in SHIPPED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file() and path.suffix in TEXT and "__pycache__" not in path.parts:
                yield path


def test_the_pattern_finds_what_it_must_and_nothing_else() -> None:
    found = [w for _, w in history("stop 37\nThis stop\nthe stop before\nIssue 14\nissues 12\nissue #3")]
    assert found == ["stop 37", "This stop", "the stop before", "Issue 14", "issues 12", "issue #3"]
    assert not list(history("a SIGSTOP before the timeout; stop_at 3; the stops of a run; issued 4 tokens"))


def test_nothing_that_ships_speaks_of_its_history() -> None:
    found = []
    for path in shipped_files():
        if path == Path(__file__):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        found += [f"{path.relative_to(ROOT)}:{n}: {w}" for n, w in history(text)]
    assert not found, "history in what ships (say what the unit does and why):\n" + "\n".join(found)


def test_the_openapi_schema_speaks_of_the_product(tmp_path: Path) -> None:
    from service.api.app import create_app
    from service.etcd.memory import MemoryStore
    from service.settings import load_settings

    app = create_app(load_settings(data_dir=tmp_path), MemoryStore(), api_token="t" * 32, secret=b"k" * 32)
    text = json.dumps(app.openapi(), indent=1)
    found = [f"/openapi.json:{n}: {w}" for n, w in history(text)]
    assert not found, "history in the published API schema (the models' docstrings):\n" + "\n".join(found)
