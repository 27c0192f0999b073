"""The Checkpointer in one process (world of one): round trips, refusal of corrupt steps,
aborted saves, async saves. Real files, no sockets, no child processes."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.checkpoint.helpers import checkpointer, model_and_optim, save, state_equal, train
from tests.waiting import eventually
from worker import failpoints
from worker.checkpoint.checkpointer import Checkpointer
from worker.checkpoint.layout import list_published, read_latest
from worker.checkpoint.verify import logical_digest, verify_checkpoint
from worker.errors import CheckpointError


@pytest.fixture(autouse=True)
def _no_failpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.reset_hits()


@pytest.mark.parametrize("async_save", [False, True])
def test_round_trip_restores_everything(tmp_path: Path, async_save: bool) -> None:
    model, optim = model_and_optim()
    train(model, optim, 3)
    ck = checkpointer(tmp_path, async_save=async_save)
    save(ck, model, optim, 3, sampler={"cursor": 15})
    ck.close()
    random.random(), np.random.rand(), torch.rand(1)  # the RNG moved on after the save
    expect = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    assert ck.stats.saves_total == 1 and read_latest(tmp_path) == "step-00000003"

    model2, optim2 = model_and_optim(seed=1)
    restored = checkpointer(tmp_path).restore(model=model2, optimizer=optim2)
    assert restored is not None and restored.step == 3 and restored.rng_restored
    assert restored.progress == {"step": 3, "samples_seen": 15, "sampler": {"cursor": 15}}
    assert state_equal(model, model2, optim, optim2)
    random.random(), np.random.rand(), torch.rand(1)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expect
    train(model, optim, 1)
    train(model2, optim2, 0)


def test_resumed_training_is_bitwise_identical(tmp_path: Path) -> None:
    model, optim = model_and_optim()
    train(model, optim, 2)
    ck = checkpointer(tmp_path)
    save(ck, model, optim, 2)
    train(model, optim, 3)
    model2, optim2 = model_and_optim(seed=5)
    checkpointer(tmp_path).restore(model=model2, optimizer=optim2)
    train(model2, optim2, 3)
    assert state_equal(model, model2, optim, optim2)


def test_no_checkpoint_and_never(tmp_path: Path) -> None:
    model, optim = model_and_optim()
    assert checkpointer(tmp_path).restore(model=model, optimizer=optim) is None
    save(checkpointer(tmp_path), model, optim, 1)
    assert checkpointer(tmp_path, resume="never").restore(model=model, optimizer=optim) is None


def _two_steps(tmp_path: Path) -> tuple[Path, Path]:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path)
    train(model, optim, 1)
    save(ck, model, optim, 1)
    train(model, optim, 1)
    save(ck, model, optim, 2)
    (_, older), (_, newer) = list_published(tmp_path)
    return older, newer


def _truncate(p: Path) -> None:
    os.truncate(p, p.stat().st_size - 1)


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [(_truncate, "truncated"), (_flip, "digest mismatch"), (os.unlink, "missing")],
)
def test_corrupt_newest_is_refused_and_previous_used(tmp_path: Path, damage, reason: str) -> None:  # type: ignore[no-untyped-def]
    older, newer = _two_steps(tmp_path)
    damage(newer / "rank-00000.bin")
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path)
    events: list[tuple[str, dict]] = []  # type: ignore[type-arg]
    ck._on_event = lambda name, fields: events.append((name, fields))
    restored = ck.restore(model=model, optimizer=optim)
    assert restored is not None and restored.step == 1 and restored.path == older
    assert ck.stats.verification_failures_total == 1
    refused = [f for n, f in events if n == "checkpoint_refused"]
    assert len(refused) == 1 and reason in refused[0]["reason"] and "rank-00000.bin" in refused[0]["reason"]
    # the refused step is set aside and latest names the step that was loaded
    assert [s for s, _ in list_published(tmp_path)] == [1]
    assert read_latest(tmp_path) == "step-00000001"
    assert any(p.name.startswith(".corrupt-step-00000002") for p in tmp_path.iterdir())


def test_garbage_manifest_is_refused(tmp_path: Path) -> None:
    _, newer = _two_steps(tmp_path)
    (newer / "manifest.json").write_text('{"format_version": 1')
    model, optim = model_and_optim()
    restored = checkpointer(tmp_path).restore(model=model, optimizer=optim)
    assert restored is not None and restored.step == 1


def test_all_corrupt_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    older, newer = _two_steps(tmp_path)
    _flip(older / "rank-00000.bin")
    _flip(newer / "rank-00000.bin")
    model, optim = model_and_optim()
    with pytest.raises(CheckpointError, match="no published checkpoint"):
        checkpointer(tmp_path).restore(model=model, optimizer=optim)


def test_explicit_path_and_other_model(tmp_path: Path) -> None:
    older, _ = _two_steps(tmp_path)
    model, optim = model_and_optim()
    restored = checkpointer(tmp_path, resume=str(older)).restore(model=model, optimizer=optim)
    assert restored is not None and restored.step == 1
    assert any(p.name.startswith(".superseded-step-00000002") for p in tmp_path.iterdir())
    other = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="does not match the model"):
        checkpointer(tmp_path).restore(model=other, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_explicit_path_is_where_a_job_starts_not_where_every_restart_goes(tmp_path: Path) -> None:
    """``resume: <another job's checkpoint>``, then this job publishes steps of its own and is
    restarted (torchrun reruns the same spec): it resumes from its own newest step, not the path
    again, and its own steps are kept. A corrupt own step falls back to an older own one."""
    source, _ = _two_steps(tmp_path / "source")
    own = tmp_path / "own"
    model, optim = model_and_optim()
    ck = checkpointer(own, resume=str(source))
    first = ck.restore(model=model, optimizer=optim)
    assert first is not None and first.path == source
    train(model, optim, 1)
    save(ck, model, optim, 2)
    train(model, optim, 1)
    save(ck, model, optim, 3)
    ck.close()

    model2, optim2 = model_and_optim(seed=3)
    again = checkpointer(own, resume=str(source)).restore(model=model2, optimizer=optim2)
    assert again is not None and again.step == 3 and again.path.parent == own
    assert state_equal(model, model2, optim, optim2)
    assert [s for s, _ in list_published(own)] == [2, 3]

    _flip(own / "step-00000003" / "rank-00000.bin")
    fallback = checkpointer(own, resume=str(source)).restore(model=model2, optimizer=optim2)
    assert fallback is not None and fallback.step == 2


def test_rollback_to_an_own_step_then_a_restart_keeps_what_was_trained_since(tmp_path: Path) -> None:
    """``resume: <a step of this job>`` rolls back (newer steps set aside); the steps published after
    that are what a restart resumes from."""
    older, _ = _two_steps(tmp_path)
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path, resume=str(older))
    rolled = ck.restore(model=model, optimizer=optim)
    assert rolled is not None and rolled.step == 1
    train(model, optim, 1)
    save(ck, model, optim, 2)
    ck.close()
    restarted = checkpointer(tmp_path, resume=str(older)).restore(model=model, optimizer=optim)
    assert restarted is not None and restarted.step == 2 and restarted.path.name == "step-00000002"
    assert any(p.name.startswith(".superseded-step-00000002") for p in tmp_path.iterdir())
    # A second rollback to the same step (another spelling of the path: a new start) sets the
    # newer step aside beside the first one set aside, never onto it.
    again = checkpointer(tmp_path, resume=f"{older}/").restore(model=model, optimizer=optim)
    assert again is not None and again.step == 1
    aside = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".superseded-step-00000002"))
    assert len(aside) == 2, aside


@pytest.mark.parametrize(
    "spec", ["during_shard_write=enospc", "after_shard_write=raise", "before_manifest_write=raise",
             "before_publish_rename=enospc"],
)  # fmt: skip
@pytest.mark.parametrize("async_save", [False, True])
def test_failed_save_is_aborted_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, async_save: bool
) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path, async_save=async_save)
    save(ck, model, optim, 1)
    ck.close()
    digest = logical_digest(tmp_path)
    monkeypatch.setenv(failpoints.ENV, spec)
    train(model, optim, 1)
    save(ck, model, optim, 2)
    ck.close()
    assert ck.stats.aborts_total == 1 and ck.stats.saves_total == 1
    assert read_latest(tmp_path) == "step-00000001" and logical_digest(tmp_path) == digest
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".staging")]
    monkeypatch.delenv(failpoints.ENV)
    train(model, optim, 1)
    save(ck, model, optim, 3)
    ck.close()
    assert read_latest(tmp_path) == "step-00000003" and verify_checkpoint(tmp_path)[1] == []


def test_retention_applied_after_publish(tmp_path: Path) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path, retention={"keep_latest": 2, "milestone_every_steps": 4})
    for step in range(1, 7):
        train(model, optim, 1)
        save(ck, model, optim, step)
    assert [s for s, _ in list_published(tmp_path)] == [4, 5, 6]
    assert ck.stats.deleted_total == 3


def test_orphans_of_other_generations_are_collected(tmp_path: Path) -> None:
    (tmp_path / ".staging-00000004-3").mkdir(parents=True)
    (tmp_path / ".trash-step-00000001-9").mkdir()
    ck = checkpointer(tmp_path)  # generation 0
    assert ck.stats.orphans_collected_total == 2
    assert not list(tmp_path.glob(".staging-*"))


def test_opened_on_a_thread_it_collects_saves_and_restores_as_one_opened_at_once(tmp_path: Path) -> None:
    (tmp_path / ".staging-00000004-3").mkdir(parents=True)
    model, optim = model_and_optim()
    train(model, optim, 2)
    ck = checkpointer(tmp_path, open_on_thread=True)
    save(ck, model, optim, 2)
    ck.close()
    assert ck.stats.orphans_collected_total == 1 and not list(tmp_path.glob(".staging-*"))
    assert ck.stats.saves_total == 1 and read_latest(tmp_path) == "step-00000002"
    model2, optim2 = model_and_optim(seed=1)
    restored = checkpointer(tmp_path, open_on_thread=True).restore(model=model2, optimizer=optim2)
    assert restored is not None and restored.step == 2 and state_equal(model, model2, optim, optim2)


def save_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Checkpointer]:
    """A generation-0 checkpointer whose async save of step 1 is staged and held mid-shard."""
    model, optim = model_and_optim()
    train(model, optim, 1)
    old = checkpointer(tmp_path, generation=0, async_save=True)
    monkeypatch.setenv(failpoints.ENV, "during_shard_write=sleep:1#1")  # the writer holds, mid-shard
    save(old, model, optim, 1)
    eventually("the old save staged", lambda: bool(list(tmp_path.glob(".staging-00000001-0"))), timeout=30)
    return model, optim, old


@pytest.mark.parametrize("waits", [True, False], ids=["after", "alone"])
def test_a_new_generation_keeps_the_save_in_flight_that_it_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waits: bool
) -> None:
    """Peer mode after a join: the old generation's async save is still writing when the new
    generation's checkpointer opens in the same process. Opened ``after`` the old one, it lets
    that save publish before its orphan scan; opened alone, its scan removes the staging
    directory under the writer and the save is aborted (why ``after`` exists)."""
    model, optim, old = save_in_flight(tmp_path, monkeypatch)
    new = checkpointer(
        tmp_path, generation=1, async_save=True, open_on_thread=waits, after=old if waits else None
    )
    train(model, optim, 1)
    save(new, model, optim, 2)
    new.close()
    old.close()
    if waits:
        assert old.stats.saves_total == 1 and old.stats.aborts_total == 0
        assert [s for s, _ in list_published(tmp_path)] == [1, 2] and new.stats.orphans_collected_total == 0
        assert verify_checkpoint(tmp_path / "step-00000001")[1] == []
    else:
        assert new.stats.orphans_collected_total == 1
        assert old.stats.aborts_total == 1 and [s for s, _ in list_published(tmp_path)] == [2]
    assert not list(tmp_path.glob(".staging-*"))


def test_saving_the_same_step_twice_is_a_no_op(tmp_path: Path) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path)
    save(ck, model, optim, 1)
    save(ck, model, optim, 1)
    assert ck.stats.saves_total == 1
    restored_ck = checkpointer(tmp_path)
    restored_ck.restore(model=model, optimizer=optim)
    save(restored_ck, model, optim, 1)  # the final step again after a restart: already published
    assert restored_ck.stats.saves_total == 0 and [s for s, _ in list_published(tmp_path)] == [1]


def test_disabled_without_dir(tmp_path: Path) -> None:
    from worker.checkpoint.checkpointer import Checkpointer
    from worker.jobspec.spec import CheckpointSpec

    ck = Checkpointer(CheckpointSpec(), job="j", spec_hash="", data_version="", rank=0, world_size=1,
                      generation=0, parallelism="ddp", seed=0, run_record={})  # fmt: skip
    model, optim = model_and_optim()
    assert not ck.should_save(10, now=1e12)
    ck.save(step=1, model=model, optimizer=optim, progress={}, metrics={})
    assert ck.restore(model=model, optimizer=optim) is None


def test_other_dtypes_round_trip(tmp_path: Path) -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3).to(torch.bfloat16)
            self.register_buffer("mask", torch.tensor([True, False, True]))
            self.register_buffer("count", torch.tensor(7, dtype=torch.int32))

    torch.manual_seed(3)
    a, b = Net(), Net()
    b.lin.weight.data.zero_()
    b.mask.zero_()
    b.count.zero_()
    oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    save(checkpointer(tmp_path), a, oa, 1)
    assert checkpointer(tmp_path).restore(model=b, optimizer=ob) is not None
    assert all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_opened_on_a_thread_it_opens_when_started_or_first_used(tmp_path: Path) -> None:
    """Peer mode starts a re-formed generation's opening after its first step: until then the
    directory is not read (an orphan stays, no session), and start_opening opens it."""
    (tmp_path / ".staging-00000004-3").mkdir(parents=True)
    ck = checkpointer(tmp_path, open_on_thread=True)
    assert ck.session == "off" and list(tmp_path.glob(".staging-*")), "opened before it was started"
    ck.start_opening()
    ck.start_opening()  # once
    eventually("the opening collected the orphan", lambda: not list(tmp_path.glob(".staging-*")), timeout=30)
    ck.close()
    assert ck.stats.orphans_collected_total == 1 and ck.session != "off"


def test_closed_before_its_opening_started_it_completes_the_save_it_waits_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation re-formed again before its first step: its checkpointer never opened. Closed
    (by the next one's opening), it opens nothing and still lets the older save it was to wait for
    publish."""
    model, optim, old = save_in_flight(tmp_path, monkeypatch)
    middle = checkpointer(tmp_path, generation=1, async_save=True, open_on_thread=True, after=old)
    new = checkpointer(tmp_path, generation=2, async_save=True, open_on_thread=True, after=middle)
    train(model, optim, 1)
    save(new, model, optim, 2)
    new.close()
    assert middle.session == "off" and middle.stats.orphans_collected_total == 0
    assert old.stats.saves_total == 1 and old.stats.aborts_total == 0
    assert [s for s, _ in list_published(tmp_path)] == [1, 2] and not list(tmp_path.glob(".staging-*"))
