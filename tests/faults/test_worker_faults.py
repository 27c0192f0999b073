"""Worker rows of the fault matrix (real torchrun, gloo, CPU), each drawn from a seed.

* SIGKILL of a random rank at a random step: resumes from the newest published checkpoint and
  ends with the uninterrupted run's digest.
* Kill at a random checkpoint failpoint on rank 0 or another rank: nothing staged is loaded,
  ``latest`` names a verified checkpoint, orphaned staging is collected, same digest.
* Truncate / flip a byte / delete a shard of the newest checkpoint: refused (counted by a
  ``checkpoint_refused`` event), the previous one is used, same digest.
* ENOSPC during a save, by failpoint and on a real 200 KiB tmpfs: the save aborts, the previous
  checkpoint stays intact, training goes on.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

from service.cli import main as elastrain
from tests.faults.conftest import Reference, seeded, train
from tests.integration.launch import run_worker, write_spec
from tests.integration.worker.test_resume import FAILPOINTS, spec

pytestmark = [pytest.mark.faults, pytest.mark.integration]


def verify(path: Path) -> bool:
    return elastrain(["checkpoint", "verify", str(path)]) == 0


@seeded
def test_sigkill_random_rank_at_random_step(tmp_path: Path, reference: Reference, seed: int) -> None:
    rng = random.Random(seed)
    rank, hit = rng.randrange(2), rng.randrange(11, 30)
    arm = f"after_grad_sync=kill@{rank}#{hit}^0"
    run = train(tmp_path, "ck", env={"ELASTRAIN_FAILPOINTS": arm})
    resumed = run.last("resumed")
    before = [e["step"] for e in run.all("checkpoint_published") if e["time"] < resumed["time"]]
    assert before and resumed["step"] == max(before), f"seed={seed} {arm}: resumed {resumed}"
    assert run.last("finished")["params_digest"] == reference.digest, f"seed={seed} {arm}"
    assert verify(tmp_path / "ck"), f"seed={seed}"


@seeded
def test_kill_at_a_checkpoint_failpoint(tmp_path: Path, reference: Reference, seed: int) -> None:
    rng = random.Random(seed)
    name = rng.choice(FAILPOINTS)
    per_rank = name in ("after_shard_write", "before_report")
    rank = rng.choice([0, 1]) if per_rank else 0
    arm = f"{name}=kill@{rank}#2^0"
    run = train(tmp_path, "ck", env={"ELASTRAIN_FAILPOINTS": arm})
    resumed = run.last("resumed")
    assert ".staging-" not in resumed["checkpoint"], f"seed={seed} {arm}: loaded staging"
    assert resumed["step"] in (10, 20), f"seed={seed} {arm}: {resumed}"
    steps = [e["step"] for e in run.all("checkpoint_published")]
    assert steps.count(30) == 1, f"seed={seed} {arm}: published {steps}"
    ck = tmp_path / "ck"
    assert (ck / "latest").read_text().strip().endswith("30") and verify(ck), f"seed={seed} {arm}"
    assert not list(ck.glob(".staging-*")), f"seed={seed} {arm}: orphaned staging was not collected"
    assert run.last("finished")["params_digest"] == reference.digest, f"seed={seed} {arm}"


@pytest.fixture(scope="module")
def twenty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("twenty")
    train(tmp, "base", max_steps=20)
    return tmp / "base"


def damage(shard: Path, how: str, rng: random.Random) -> None:
    data = bytearray(shard.read_bytes())
    if how == "truncate":
        shard.write_bytes(bytes(data[: rng.randrange(len(data))]))
    elif how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()


@seeded
def test_corrupt_newest_shard_is_refused(
    tmp_path: Path, twenty: Path, reference: Reference, seed: int
) -> None:
    rng = random.Random(seed)
    ck = tmp_path / "ck"
    shutil.copytree(twenty, ck)
    how = rng.choice(["truncate", "flip", "delete"])
    shard = rng.choice(sorted((ck / "step-00000020").glob("*.bin")))
    damage(shard, how, rng)
    what = f"seed={seed} {how} {shard.name}"
    run = run_worker(write_spec(tmp_path, spec(ck)), nproc=2)
    assert run.code == 0, f"{what}: {run.stderr[-3000:]}"
    refused = run.all("checkpoint_refused")
    assert refused and all("step-00000020" in e["path"] and e["reason"] for e in refused), what
    assert run.last("resumed")["step"] == 10, what
    assert run.last("finished")["params_digest"] == reference.digest, what
    assert list(ck.glob("*step-00000020*")) and verify(ck), what  # set aside, the dir verifies


@seeded
def test_enospc_failpoint_during_a_save(tmp_path: Path, reference: Reference, seed: int) -> None:
    rng = random.Random(seed)
    rank, where = rng.randrange(2), rng.choice(["during_shard_write", "after_shard_write"])
    arm = f"{where}=enospc@{rank}#2"
    run = train(tmp_path, "ck", env={"ELASTRAIN_FAILPOINTS": arm})
    aborted = [e for e in run.events if "abort" in e["event"]]
    assert aborted and aborted[0]["step"] == 20, f"seed={seed} {arm}: {aborted}"
    assert [e["step"] for e in run.all("checkpoint_published")] == [10, 30], f"seed={seed} {arm}"
    assert verify(tmp_path / "ck") and not list((tmp_path / "ck").glob(".staging-*")), f"seed={seed} {arm}"
    assert run.last("finished")["params_digest"] == reference.digest, f"seed={seed} {arm}"


def test_enospc_on_a_real_small_tmpfs(tmp_path: Path, reference: Reference) -> None:
    """200 KiB holds one ~110 KiB checkpoint, not two: later saves hit a real ENOSPC (skip-and-go-on
    policy: they abort, the step-10 checkpoint stays published and verifies, training finishes)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({mounted.stderr.strip()[:120]}; needs root or CAP_SYS_ADMIN): "
            "the enospc-failpoint row covers ENOSPC"
        )
    try:
        run = run_worker(write_spec(tmp_path, spec(mnt / "ck")), nproc=2, max_restarts=2)
        assert run.code == 0, run.stderr[-4000:]
        published = [e["step"] for e in run.all("checkpoint_published")]
        aborted = sorted({e["step"] for e in run.events if "abort" in e["event"]})
        assert published and published[0] == 10 and aborted, (published, aborted)
        assert set(published).isdisjoint(aborted) and set(published) | set(aborted) == {10, 20, 30}
        assert verify(mnt / "ck") and not list((mnt / "ck").glob(".staging-*"))
        latest = (mnt / "ck" / "latest").read_text().strip()
        assert latest.endswith(f"{max(published):08d}"), latest
        assert run.last("finished")["params_digest"] == reference.digest
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
