"""Manifests are read with limits: a size cap, a depth cap, the schema, and
every number that sizes a read or an allocation checked against the files on disk first. A
refused manifest is refused like a corrupt shard: resume falls back to the previous step, the
CLI prints one line. Memory is measured as "bounded" (tracemalloc peak), never as a time."""

from __future__ import annotations

import json
import os
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from service.cli import main as cli_main
from tests.unit.checkpoint.helpers import checkpointer, model_and_optim, save, train
from tests.unit.checkpoint.synth import TENSORS, synth, write_published
from worker.checkpoint.export import export_weights
from worker.checkpoint.layout import list_published, load_manifest
from worker.checkpoint.manifest import MANIFEST_BASE_BYTES, MAX_BLOCK_SIZE, MAX_DEPTH, manifest_cap
from worker.checkpoint.offline import reshard
from worker.checkpoint.verify import logical_digest, verify_checkpoint
from worker.errors import CheckpointError, CorruptCheckpointError

GiB = 1 << 30


@contextmanager
def peak_memory() -> Iterator[list[int]]:
    """The peak of Python allocations inside the block (in bytes), as ``out[0]``."""
    out = [0]
    tracemalloc.start()
    try:
        yield out
    finally:
        out[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def _published(tmp_path: Path) -> Path:
    job = tmp_path / "job"
    write_published(job, synth(TENSORS, 2, block_size=16))
    return job / "step-00000010"


def _raw(step_dir: Path) -> dict[str, Any]:
    raw: dict[str, Any] = json.loads((step_dir / "manifest.json").read_text())
    return raw


def bomb(step_dir: Path) -> str:
    (step_dir / "manifest.json").write_bytes(b"[" * 200_000 + b"]" * 200_000)
    return f"nested 200000 levels deep; at most {MAX_DEPTH}"


def huge(step_dir: Path) -> str:
    os.truncate(step_dir / "manifest.json", 300 << 20)  # sparse: costs no disk
    return "314572800 bytes is over the limit"


def huge_block(step_dir: Path) -> str:
    raw = _raw(step_dir)
    raw["block_size"] = 6 * GiB
    for t in raw["tensors"].values():
        for p in t["pieces"]:
            p["digests"] = p["digests"][:1]
    (step_dir / "manifest.json").write_text(json.dumps(raw))
    return f"block_size 6442450944 is over the limit of {MAX_BLOCK_SIZE}"


def larger_than_files(step_dir: Path) -> str:
    """A self-consistent manifest whose one tensor, piece and file are 8 GiB; the file has 64
    bytes: the numbers would size a 2 GiB row buffer before any read noticed."""
    raw = _raw(step_dir)
    rows, cols = 4, 1 << 29
    nbytes = rows * cols * 4
    block = MAX_BLOCK_SIZE
    piece = {"file": "rank-00000.bin", "offset": 0, "nbytes": nbytes, "rows": [0, rows],
             "digests": ["0" * 32] * -(-nbytes // block)}  # fmt: skip
    raw.update(block_size=block, rank_meta={})
    raw["tensors"] = {
        "model.w": {"dtype": "float32", "shape": [rows, cols], "kind": "replicated", "pieces": [piece]}
    }
    raw["files"] = {"rank-00000.bin": {"size": nbytes, "digest": "0" * 32}}
    (step_dir / "rank-00001.bin").unlink()
    (step_dir / "rank-00000.bin").write_bytes(bytes(64))
    (step_dir / "manifest.json").write_text(json.dumps(raw))
    return "rank-00000.bin: 64 bytes on disk, the manifest says 8589934592"


def shape_without_bytes(step_dir: Path) -> str:
    """Rows of zero bytes cost nothing to store; 10**18 of them must not cost a loop either."""
    raw = _raw(step_dir)
    raw["tensors"]["model.empty"]["shape"] = [10**18, 0]
    raw["tensors"]["model.empty"]["pieces"] = [
        {"file": "rank-00000.bin", "offset": 0, "nbytes": 0, "rows": [0, 10**18], "digests": []}
    ]
    (step_dir / "manifest.json").write_text(json.dumps(raw))
    return ""


CRAFTED: list[Callable[[Path], str]] = [bomb, huge, huge_block, larger_than_files]


@pytest.mark.parametrize("craft", CRAFTED)
def test_crafted_manifest_is_refused_in_one_line_without_a_big_allocation(
    tmp_path: Path, craft: Callable[[Path], str]
) -> None:
    step_dir = _published(tmp_path)
    expect = craft(step_dir)
    for read in (load_manifest, logical_digest, lambda d: reshard(d, tmp_path / "re", world_size=1),
                 lambda d: export_weights(d, tmp_path / "ex")):  # fmt: skip
        with peak_memory() as peak, pytest.raises(CorruptCheckpointError) as info:
            read(step_dir)
        message = str(info.value)
        assert expect in message and "\n" not in message, message
        assert str(step_dir) in message
        assert peak[0] < 32 << 20, f"{craft.__name__}: {peak[0]} bytes allocated"


def test_zero_byte_rows_do_not_loop(tmp_path: Path) -> None:
    step_dir = _published(tmp_path)
    shape_without_bytes(step_dir)
    before = logical_digest(step_dir)  # loads and digests; 10**18 empty rows read as nothing
    assert before == logical_digest(step_dir) and verify_checkpoint(step_dir)[1] == []


@pytest.mark.parametrize("command", ["verify", "inspect", "digest", "reshard", "export-weights"])
@pytest.mark.parametrize("craft", CRAFTED)
def test_cli_prints_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, craft: Callable[[Path], str]
) -> None:
    step_dir = _published(tmp_path)
    expect = craft(step_dir)
    extra = {"reshard": [str(tmp_path / "re"), "--world-size", "1"], "export-weights": [str(tmp_path / "ex")]}
    code = cli_main(["checkpoint", command, str(step_dir), *extra.get(command, [])])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if command == "verify" and craft is larger_than_files:  # a shard problem: verify's own report
        assert code == 1 and "MISMATCH" in out and "rank-00000.bin" in out and "8589934592" in out
        return
    if command == "inspect" and craft is larger_than_files:  # what the manifest says (no shard read)
        assert code == 0 and "8.0 GiB" in out
        return
    assert code != 0 and out == ""
    assert len(err.splitlines()) == 1 and expect in err and str(step_dir) in err, err


def test_manifest_cap_grows_with_the_shards_on_disk() -> None:
    assert manifest_cap(0) == MANIFEST_BASE_BYTES
    # 1/64 of the shard bytes on top: more than 44 bytes of digest per 4 KiB block
    assert manifest_cap(100 * GiB) == MANIFEST_BASE_BYTES + 100 * GiB // 64
    assert 44 * (100 * GiB // 4096) < manifest_cap(100 * GiB) - MANIFEST_BASE_BYTES


def test_a_big_manifest_next_to_big_shards_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap is derived from the bytes on disk: a manifest over the base limit is read when
    the step's shards are large enough to need it (a sparse file: no disk is used)."""
    monkeypatch.setattr("worker.checkpoint.manifest.model.MANIFEST_BASE_BYTES", 1 << 20)
    step_dir = _published(tmp_path)
    raw = _raw(step_dir)
    raw["run_record"] = {"pad": "x" * (1 << 20)}
    (step_dir / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CorruptCheckpointError, match="over the limit"):
        load_manifest(step_dir)
    with open(step_dir / "ballast.bin", "wb") as f:  # bytes of this step on disk
        f.truncate(64 << 20)
    assert load_manifest(step_dir).run_record["pad"].startswith("xxx")


@pytest.mark.parametrize("craft", [bomb, huge, huge_block])
def test_resume_skips_a_refused_manifest_and_uses_the_previous_step(
    tmp_path: Path, craft: Callable[[Path], str]
) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path)
    for step in (1, 2):
        train(model, optim, 1)
        save(ck, model, optim, step)
    (_, older), (_, newer) = list_published(tmp_path)
    if craft is huge_block:
        raw = _raw(newer)
        raw["block_size"] = 6 * GiB
        for t in raw["tensors"].values():
            for p in t["pieces"]:
                p["digests"] = p["digests"][:1]
        (newer / "manifest.json").write_text(json.dumps(raw))
        expect = "block_size 6442450944"
    else:
        expect = craft(newer).split(";")[0]
    model2, optim2 = model_and_optim(seed=3)
    ck2 = checkpointer(tmp_path)
    events: list[tuple[str, dict[str, Any]]] = []
    ck2._on_event = lambda name, fields: events.append((name, fields))
    restored = ck2.restore(model=model2, optimizer=optim2)
    assert restored is not None and restored.step == 1 and restored.path == older
    assert ck2.stats.verification_failures_total == 1
    (refused,) = [f for n, f in events if n == "checkpoint_refused"]
    assert expect in refused["reason"] and "manifest.json" in refused["reason"]


def test_a_manifest_the_reader_would_refuse_is_never_published(tmp_path: Path) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path)
    deep: dict[str, Any] = {}
    for _ in range(MAX_DEPTH + 5):
        deep = {"d": deep}
    save(ck, model, optim, 1, deep=deep)
    assert ck.stats.aborts_total == 1 and list_published(tmp_path) == []
    save(ck, model, optim, 2)
    assert [s for s, _ in list_published(tmp_path)] == [2]


def test_schema_bounds_numbers_before_use(tmp_path: Path) -> None:
    step_dir = _published(tmp_path)
    raw = _raw(step_dir)
    raw["tensors"]["model.big"]["shape"] = [40] + [1] * 100
    (step_dir / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CorruptCheckpointError, match="dimensions"):
        load_manifest(step_dir)
    raw["tensors"]["model.big"]["shape"] = [40, 2**70]
    (step_dir / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CorruptCheckpointError, match="out of range"):
        load_manifest(step_dir)


def test_a_manifest_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    step_dir = _published(tmp_path)
    (step_dir / "manifest.json").unlink()
    (step_dir / "manifest.json").symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match="not a regular file"):
        load_manifest(step_dir)
