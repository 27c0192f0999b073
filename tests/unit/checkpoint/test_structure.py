"""The checkpoint package's shape: no import loop, one record type per thing, and
the wire and disk formats exactly as older versions wrote them."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

from tests.unit.checkpoint.helpers import checkpointer, model_and_optim, state_equal
from tests.unit.checkpoint.synth import TENSORS, reports_for
from worker.checkpoint import commit, manifest, saveplan
from worker.checkpoint.commit import report_from_json, report_to_json
from worker.checkpoint.verify import logical_digest, verify_checkpoint

PACKAGE = Path(__file__).parents[3] / "worker" / "checkpoint"
DATA = Path(__file__).with_name("data")


def _imports(path: Path) -> set[str]:
    """Every ``worker.checkpoint.*`` module a file imports, wherever the import statement sits
    (module level, ``TYPE_CHECKING`` blocks, inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n.split(".")[2] for n in names if n.startswith("worker.checkpoint.") and n.count(".") >= 2}
    return out


def test_no_import_loop_in_the_checkpoint_package() -> None:
    files = {p.stem: [p] for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    files |= {d.name: sorted(d.glob("*.py")) for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()}
    modules = set(files)
    graph = {m: set().union(*(_imports(f) for f in files[m])) & modules - {m} for m in modules}

    def reaches(start: str, target: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == target or (nxt not in seen and reaches(nxt, target, seen | {nxt})):
                return True
        return False

    loops = sorted(m for m in modules if reaches(m, m, {m}))
    assert loops == [], f"import loops through {loops}"


def test_the_checkpointer_lives_in_a_module_named_for_it() -> None:
    from worker.checkpoint import Checkpointer
    from worker.checkpoint.checkpointer import Checkpointer as Direct

    assert Checkpointer is Direct
    assert not _imports(PACKAGE / "restore.py") & {"api", "checkpointer"}  # it takes what it needs


def test_one_record_type_per_thing() -> None:
    assert not hasattr(commit, "PieceRecord")
    assert commit.Report.__dataclass_fields__["pieces"].type == "tuple[tuple[str, Piece], ...]"
    assert commit.Report.__dataclass_fields__["tensors"].type == "dict[str, TensorEntry]"
    # rows / row_bytes are defined once, for the manifest's entries and the save plan's infos
    assert "def rows" not in (PACKAGE / "saveplan.py").read_text()
    assert (
        saveplan.TensorInfo("t", "float32", (3, 4)).row_bytes
        == manifest.TensorEntry("float32", (3, 4), "replicated").row_bytes
        == 16
    )


def test_report_json_is_what_older_versions_sent() -> None:
    golden = json.loads((DATA / "v1-reports.json").read_text())
    reports = reports_for(TENSORS, 2, block_size=16)[0]
    assert [report_to_json(r) for r in reports] == golden["reports"]
    assert [report_from_json(text) for text in golden["reports"]] == reports


def test_a_checkpoint_written_by_an_older_version_still_loads(tmp_path: Path) -> None:
    """``data/v1-step`` was written by the release before this restructuring (a tiny model and
    AdamW after 2 steps, W=1, 128-byte blocks)."""
    job = tmp_path / "job"
    shutil.copytree(DATA / "v1-step", job / "step-00000002")
    assert verify_checkpoint(job)[1] == []
    assert logical_digest(job) == json.loads((DATA / "v1-reports.json").read_text())["logical_digest"]
    model, optim = model_and_optim(seed=1)
    restored = checkpointer(job).restore(model=model, optimizer=optim)
    assert restored is not None and restored.step == 2 and restored.rng_restored
    again, again_optim = model_and_optim(seed=2)
    checkpointer(job).restore(model=again, optimizer=again_optim)
    assert state_equal(model, again, optim, again_optim)
