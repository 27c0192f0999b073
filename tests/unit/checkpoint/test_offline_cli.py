"""reshard, export-weights and the ``elastrain checkpoint`` commands on synthetic checkpoints:
in-process through the CLI's own ``main()`` (no child process, no socket), and a static check
that the CLI's import graph stays torch-free."""

from __future__ import annotations

import ast
import dataclasses
import json
import struct
from pathlib import Path

import pytest

import service
import worker
from service.cli import main as cli_main
from tests.unit.checkpoint.synth import TENSORS, logical_bytes, synth, write_published
from worker.checkpoint.export import export_weights
from worker.checkpoint.loadplan import needs_for_rank
from worker.checkpoint.offline import reshard
from worker.checkpoint.verify import load_manifest, logical_digest, verify_checkpoint
from worker.errors import CheckpointError

META = {
    "progress": {"step": 10, "samples_seen": 640, "batch_plan": {"accum": 2}},
    "extra": {"x.lr": 0.1, "x.eps": 1e-8},
}


def _src(tmp_path: Path, world: int = 2) -> Path:
    s = synth(TENSORS, world, block_size=16)
    s.manifest = dataclasses.replace(s.manifest, meta=META)
    write_published(tmp_path / "src", s)
    return tmp_path / "src"


def run(*argv: str) -> int:
    """``elastrain checkpoint ARGV...`` through the real dispatcher, in this process."""
    return cli_main(["checkpoint", *argv])


@pytest.mark.parametrize("world", [1, 3, 4])
def test_reshard_keeps_the_logical_digest(tmp_path: Path, world: int) -> None:
    src = _src(tmp_path)
    out = reshard(src, tmp_path / f"w{world}", world_size=world)
    m = load_manifest(out)
    assert m.world_size == world and len(m.files) == world
    assert logical_digest(out) == logical_digest(src)
    assert verify_checkpoint(out)[1] == []
    assert m.run_record["resharded"]["from_world_size"] == 2
    assert "rank1/extra" in m.tensors if world > 1 else "rank1/extra" not in m.tensors
    # sharded tensors follow FSDP's layout: each rank's need is one piece in its own file
    for rank in range(world):
        for need in needs_for_rank(m, rank=rank, world_size=world):
            if m.tensors[need.name].kind == "sharded" and need.stop > need.start:
                (piece,) = [p for p in m.tensors[need.name].pieces if p.rows == (need.start, need.stop)]
                assert piece.file == f"rank-{rank:05d}.bin"


def test_reshard_refuses_an_existing_step(tmp_path: Path) -> None:
    src = _src(tmp_path)
    with pytest.raises(CheckpointError, match="already has"):
        reshard(src, src, world_size=3)


def test_digest_ignores_world_dependent_progress_and_lr(tmp_path: Path) -> None:
    s = synth(TENSORS, 2, block_size=16)
    a = dataclasses.replace(s.manifest, meta=META)
    other = {
        "progress": {**META["progress"], "batch_plan": {"accum": 3}},
        "extra": {"x.lr": 0.2, "x.eps": 1e-8},
    }
    b = dataclasses.replace(s.manifest, meta=other)
    s.manifest = a
    write_published(tmp_path / "a", s)
    s.manifest = b
    write_published(tmp_path / "b", s)
    assert logical_digest(tmp_path / "a") == logical_digest(tmp_path / "b")
    changed = {"progress": {**META["progress"], "samples_seen": 641}, "extra": META["extra"]}
    s.manifest = dataclasses.replace(s.manifest, meta=changed)
    write_published(tmp_path / "c", s)
    assert logical_digest(tmp_path / "c") != logical_digest(tmp_path / "a")


def test_export_weights_is_safetensors_and_not_resumable(tmp_path: Path) -> None:
    src = _src(tmp_path)
    done = export_weights(src, tmp_path / "export")
    path, count, nbytes = done.path, done.tensors, done.bytes
    data = path.read_bytes()
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])
    body = data[8 + hlen :]
    assert header["__metadata__"]["elastrain"] == "weights only"
    assert set(header) - {"__metadata__"} == {"a.weight", "a.bias", "b.weight", "big", "empty"} and count == 5
    begin, end = header["big"]["data_offsets"]
    assert header["big"]["dtype"] == "F32" and body[begin:end] == logical_bytes(
        "model.big", "float32", (40, 3)
    )
    assert header["b.weight"]["dtype"] == "BF16" and len(body) == nbytes
    marker = json.loads((tmp_path / "export" / "EXPORT.json").read_text())
    assert marker["resumable"] is False and "cannot resume training" in marker["note"]
    with pytest.raises(CheckpointError, match="weights-only export"):
        logical_digest(tmp_path / "export")


def test_cli_inspect_verify_digest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _src(tmp_path)
    assert run("inspect", str(src), "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["step"], info["world_size"], info["samples_seen"], info["parallelism"]) == (
        10,
        2,
        640,
        "ddp",
    )
    assert set(info["files"]) == {"rank-00000.bin", "rank-00001.bin"}
    assert run("inspect", str(src)) == 0
    table = capsys.readouterr().out
    assert "samples_seen" in table and "640" in table
    assert run("verify", str(src)) == 0
    assert capsys.readouterr().out.startswith("OK ")
    assert run("digest", str(src)) == 0
    assert capsys.readouterr().out.split()[0] == logical_digest(src)


def test_cli_verify_names_file_and_offset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _src(tmp_path)
    shard = src / "step-00000010" / "rank-00001.bin"
    data = bytearray(shard.read_bytes())
    data[40] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert run("verify", str(src)) == 1
    out = capsys.readouterr().out
    assert "rank-00001.bin offset 32: block digest mismatch" in out  # block of 16 bytes holding byte 40
    shard.unlink()
    assert run("verify", str(src)) == 1
    assert "rank-00001.bin: shard file is missing" in capsys.readouterr().out


def test_cli_reshard_and_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _src(tmp_path)
    assert run("reshard", str(src), str(tmp_path / "dst"), "--world-size", "3") == 0
    assert "to 3 ranks" in capsys.readouterr().out
    assert run("export-weights", str(src), str(tmp_path / "w")) == 0
    assert "cannot resume training" in capsys.readouterr().out


# Where the packages are imported from: this checkout, or the installed wheel (make test-installed).
ROOTS = {pkg.__name__: Path(pkg.__file__ or "").resolve().parents[1] for pkg in (service, worker)}
TORCH_FREE = [
    "service.cli.checkpoint", "worker.checkpoint.coordinator", "worker.checkpoint.retention",
    "worker.checkpoint.interval", "worker.checkpoint.export", "worker.checkpoint.owner",
    "worker.jobspec.jsonlimits",
]  # fmt: skip


def _module_file(name: str) -> Path | None:
    base = ROOTS[name.split(".")[0]].joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _import_time_imports(path: Path) -> set[str]:
    """Modules a file imports when it is imported: module level, class bodies, ``if``/``try``
    blocks, not function bodies nor ``if TYPE_CHECKING:`` (those run later or never)."""
    out: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + [s for h in node.handlers for s in h.body] + node.orelse + node.finalbody)
            elif isinstance(node, ast.ClassDef):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return out


def imported_packages(root: str) -> set[str]:
    """Top-level names of every third-party package importing ``root`` imports (statically,
    following elastrain's own modules and their parent packages)."""
    seen: set[str] = set()
    todo, external = [root], set()
    while todo:
        name = todo.pop()
        parts = name.split(".")
        if parts[0] not in ("service", "worker"):
            external.add(parts[0])
            continue
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__ too
            module = ".".join(parts[:i])
            path = _module_file(module)
            if path is None or module in seen:
                continue
            seen.add(module)
            todo.extend(_import_time_imports(path))
    return external


@pytest.mark.parametrize("root", TORCH_FREE)
def test_the_cli_and_the_pure_modules_do_not_import_torch(root: str) -> None:
    assert not imported_packages(root) & {"torch", "transformers"}, root


def test_the_import_check_sees_torch_where_it_is() -> None:
    assert "torch" in imported_packages("worker.checkpoint.checkpointer")
    assert "numpy" in imported_packages("worker.checkpoint.export")
