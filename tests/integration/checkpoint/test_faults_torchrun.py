"""Faults under real torchrun: one run SIGKILLed at a chain of checkpoint failpoints (one per
attempt: every failpoint in ``make faults``, two drawn in ``make test``), and a corrupt newest
checkpoint. Seeded (ELASTRAIN_FAULT_SEED picks the failpoints and which rank dies where); the seed
is in every assertion message."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest

from tests.integration.checkpoint.conftest import EVERY, SEED, STEPS, Reference
from tests.integration.checkpoint.harness import torchrun
from tests.seeds import seeded, sweeping
from worker.checkpoint.layout import list_published, read_latest
from worker.checkpoint.verify import logical_digest, verify_checkpoint

pytestmark = pytest.mark.integration
BEFORE_REPORT = ["during_shard_write", "after_shard_write", "before_report"]
COORDINATOR = [
    "before_manifest_write", "before_publish_rename", "after_publish_rename", "before_latest_update",
    "after_latest_update", "before_retention_delete",
]  # fmt: skip


def kill_plan(seed: int, every: bool) -> list[tuple[str, int]]:
    """(failpoint, rank) for attempts 0, 1, ...: the phase-1 failpoints on a random rank, the
    coordinator's on rank 0, in the order a save meets them. ``every``: all of them (``make
    faults``); else one phase-1 failpoint and one of the coordinator's, drawn from the seed, so
    that one run still chains kills in both phases (``make test``)."""
    rng = random.Random(seed)
    before = BEFORE_REPORT if every else [rng.choice(BEFORE_REPORT)]
    after = COORDINATOR if every else [rng.choice(COORDINATOR)]
    return [(name, rng.randrange(2)) for name in before] + [(name, 0) for name in after]


@seeded
def test_kill_at_every_failpoint(seed: int, reference_ddp: Reference, tmp_path: Path) -> None:
    plan = kill_plan(seed, every=sweeping())
    spec = ",".join(f"{name}=kill@{rank}^{attempt}" for attempt, (name, rank) in enumerate(plan))
    d = tmp_path / "ddp"
    # exactly as many restarts as kills: a lost restart (pytorch#135712) fails the job
    run = torchrun(
        2, "--dir", str(d), "--async-save", "--steps", str(STEPS), "--every", str(EVERY), "--seed", str(SEED),
        max_restarts=len(plan), extra_env={"ELASTRAIN_FAILPOINTS": spec}, timeout=600,
    )  # fmt: skip
    msg = f"fault seed {seed}, plan {plan}"
    run.check()
    starts = run.all("started")
    assert [s["attempt"] for s in starts] == [str(a) for a in range(len(plan) + 1)], msg
    for name, _ in plan:
        assert f"elastrain failpoint {name}: kill" in run.stderr, f"{name} never fired; {msg}"
    # at every start, latest (if any) named a checkpoint that verifies
    checks = run.all("latest_check")
    assert checks and all(c["problems"] == [] for c in checks), f"{checks}; {msg}"
    # every resume loaded a published step directory, never a staging directory
    resumed = run.all("resumed")
    assert resumed and all(Path(r["path"]).name.startswith("step-") for r in resumed), msg
    assert [r["step"] for r in resumed] == sorted(r["step"] for r in resumed), msg
    # the job finished, and its final state is bit-for-bit the uninterrupted run's
    assert run.last("finished")["digest"] == reference_ddp.digest, msg
    assert read_latest(d) == "step-00000008" and verify_checkpoint(d)[1] == [], msg
    assert not list(d.glob(".staging-*")), msg


def _truncate(p: Path) -> None:
    os.truncate(p, p.stat().st_size // 2)


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x10
    p.write_bytes(bytes(data))


DAMAGE = {"truncate": ("rank-00000.bin", _truncate, "truncated"),
          "flip": ("rank-00001.bin", _flip, "block digest mismatch"),
          "delete": ("rank-00001.bin", os.unlink, "missing")}  # fmt: skip


def test_corrupt_newest_is_refused_and_previous_loaded(reference_ddp: Reference, tmp_path: Path) -> None:
    published = [s for s, _ in list_published(reference_ddp.dir)]
    newest, previous = published[-1], published[-2]
    dirs = []
    for kind, (shard, damage, _) in DAMAGE.items():
        d = tmp_path / kind
        shutil.copytree(reference_ddp.dir, d)
        # a complete but unpublished newer save: must never be loaded
        shutil.copytree(d / f"step-{newest:08d}", d / ".staging-00000099-0")
        damage(d / f"step-{newest:08d}" / shard)
        dirs.append(d)
    run = torchrun(2, "--phase", "restore-only", "--restore-dirs", ",".join(map(str, dirs))).check()
    restored = run.all("restored_from")
    refused = run.all("checkpoint_refused")
    assert [r["step"] for r in restored] == [previous] * 3
    assert len(refused) == 3
    for d, event, (kind, (shard, _, reason)) in zip(dirs, refused, DAMAGE.items(), strict=True):
        assert shard in event["reason"] and reason in event["reason"], (kind, event)
        assert read_latest(d) == f"step-{previous:08d}"
        assert (d / f".corrupt-step-{newest:08d}-g0").is_dir()
        assert (d / ".staging-00000099-0").is_dir()  # untouched, unread
        assert logical_digest(d) != reference_ddp.digest
