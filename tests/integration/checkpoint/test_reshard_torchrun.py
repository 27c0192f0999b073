"""Save at W=2 (DDP and FSDP2), load at W'=1, 3, 4: equal logical digest, training goes on.
Also: async saves with an ENOSPC on one rank, and the CLI on real checkpoints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.checkpoint.conftest import EVERY, SEED, STEPS, Reference
from tests.integration.checkpoint.harness import Run, cli, torchrun
from worker.checkpoint.layout import list_published, read_latest
from worker.checkpoint.verify import load_manifest, logical_digest, verify_checkpoint

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def fsdp_async_enospc(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    """FSDP2 at W=2, async saves; rank 1 runs out of space during its second save (step 4)."""
    d = tmp_path_factory.mktemp("fsdp") / "fsdp"
    run = torchrun(
        2, "--dir", str(d), "--parallelism", "fsdp", "--async-save", "--steps", str(STEPS),
        "--every", str(EVERY), "--seed", str(SEED),
        extra_env={"ELASTRAIN_FAILPOINTS": "during_shard_write=enospc@1#2"},
    ).check()  # fmt: skip
    return d, run


def test_enospc_aborts_the_save_and_training_goes_on(fsdp_async_enospc: tuple[Path, Run]) -> None:
    d, run = fsdp_async_enospc
    (aborted,) = run.all("checkpoint_aborted")
    assert aborted["step"] == 4 and "rank 1" in aborted["reason"] and "No space left" in aborted["reason"]
    # the step after the abort still found the previous latest; the job went on to publish 6 and 8
    assert [e["latest"] for e in run.all("saved") if e["step"] == 6] == ["step-00000002"]
    assert [s for s, _ in list_published(d)] == [2, 6, 8] and read_latest(d) == "step-00000008"
    assert not list(d.glob(".staging-*"))
    assert load_manifest(d / "step-00000008").parallelism == "fsdp"
    sharded = [n for n, t in load_manifest(d / "step-00000008").tensors.items() if t.kind == "sharded"]
    assert "model.0.weight" in sharded and "optim.state.0.weight.exp_avg" in sharded


@pytest.fixture(scope="module")
def offline_w3(reference_ddp: Reference, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("offline") / "ddp-w3"
    res = cli("reshard", str(reference_ddp.dir), str(out), "--world-size", "3")
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.parametrize("new_world", [1, 3, 4])
def test_load_at_another_world_size_keeps_the_logical_digest(
    new_world: int, reference_ddp: Reference, fsdp_async_enospc: tuple[Path, Run], offline_w3: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    fsdp_dir, fsdp_run = fsdp_async_enospc
    jobs = [
        ["ddp", str(reference_ddp.dir), str(tmp_path / "ddp")],
        ["fsdp", str(fsdp_dir), str(tmp_path / "fsdp")],
    ]
    if new_world == 3:  # the offline resharder's output loads like any checkpoint
        jobs.append(["ddp", str(offline_w3), str(tmp_path / "ddp-offline")])
    run = torchrun(new_world, "--phase", "resave", "--jobs", json.dumps(jobs), "--seed", str(SEED)).check()
    expect = {"ddp": reference_ddp.digest, "fsdp": fsdp_run.last("finished")["digest"]}
    resaved = run.all("resaved")
    assert len(resaved) == len(jobs)
    for event, (parallelism, _, dst) in zip(resaved, jobs, strict=True):
        assert event["step"] == STEPS
        assert event["digest"] == expect[parallelism] == logical_digest(dst), f"seed {SEED}, {parallelism}"
        assert load_manifest(Path(dst) / "step-00000008").world_size == new_world
        # ranks that existed at W=2 got their RNG back; new ranks derived it and say so
        for rank, (restored, notes) in enumerate(event["rng"]):
            existed = rank < 2
            assert restored is existed
            assert existed or any("derived from (seed" in n for n in notes)
    assert all(e["finite"] for e in run.all("continued"))


def test_cli_on_a_real_checkpoint(reference_ddp: Reference) -> None:
    d = reference_ddp.dir
    res = cli("verify", str(d))
    assert res.returncode == 0 and res.stdout.startswith("OK "), res.stderr
    res = cli("digest", str(d))
    assert res.stdout.split()[0] == reference_ddp.digest
    info = json.loads(cli("inspect", str(d / "step-00000008"), "--json").stdout)
    assert (info["step"], info["world_size"], info["samples_seen"], info["parallelism"]) == (8, 2, 64, "ddp")
    assert sorted(info["files"]) == ["rank-00000.bin", "rank-00001.bin"]
    res = cli("verify", str(d / ".staging-00000010-0"))
    assert res.returncode == 2 and "never read" in res.stderr


def test_cli_verify_names_the_bad_file_and_offset(reference_ddp: Reference, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(reference_ddp.dir, copy)
    shard = copy / "step-00000008" / "rank-00001.bin"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 1
    shard.write_bytes(bytes(data))
    res = cli("verify", str(copy))
    assert res.returncode == 1
    # blocks (256 bytes in the toy job) start at each piece: the one holding byte 1000 is named
    match = re.search(r"rank-00001\.bin offset (\d+): block digest mismatch \((\d+) bytes\)", res.stdout)
    assert match, res.stdout
    start, size = int(match.group(1)), int(match.group(2))
    assert start <= 1000 < start + size <= start + 256
    assert [p.offset for p in verify_checkpoint(copy)[1]] == [start]
