"""Async saves with a pipelined snapshot (one process, real files, no sockets): the checkpoint
holds the state of the save step although training goes on while the snapshot is copied, resume
from it is bit for bit, and the fence is a no-op when nothing is pending."""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.checkpoint.helpers import checkpointer, model_and_optim, save, state_equal, train
from worker import failpoints
from worker.checkpoint.asyncsave import SnapshotBuffers, lower_priority
from worker.checkpoint.layout import read_latest
from worker.checkpoint.verify import logical_digest

WRITER = "elastrain-checkpoint-writer"


@pytest.fixture(autouse=True)
def _no_failpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(failpoints.ENV, raising=False)
    failpoints.reset_hits()


class FenceClock:
    """The writer's clock (``AsyncWriter.clock``), held by the test: it reads 0 until the fence
    starts waiting (its first reading), then a second thread moves it on by ``WAIT_S`` and only
    then lets the snapshot copy run. The copy therefore always finishes while the fence waits,
    and the fence measures exactly ``WAIT_S``, however fast the threads run."""

    WAIT_S = 7.0

    def __init__(self, release: threading.Event) -> None:
        self.now = 0.0
        self.fence_started = threading.Event()
        self.thread = threading.Thread(target=self._release, args=(release,), daemon=True)
        self.thread.start()

    def __call__(self) -> float:
        self.fence_started.set()
        return self.now

    def _release(self, release: threading.Event) -> None:
        if self.fence_started.wait(30):
            self.now += self.WAIT_S
            release.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[str]]]:
    """Holds the writer thread's copy until the event is set; ``order`` records what happened."""
    release, order = threading.Event(), []
    original = SnapshotBuffers.copy

    def held(self: SnapshotBuffers, items: list) -> list:  # type: ignore[type-arg]
        if threading.current_thread().name == WRITER:
            assert release.wait(30), "the snapshot copy was never released (did the fence wait?)"
            out = original(self, items)
            order.append("copied")
            return out
        return original(self, items)

    monkeypatch.setattr(SnapshotBuffers, "copy", held)
    yield release, order
    release.set()


def forward_backward(model: nn.Module) -> None:
    model.train()
    model(torch.randn(5, 6)).pow(2).mean().backward()


def test_async_checkpoint_equals_sync_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    runs = {}
    for mode in ("sync", "async"):
        torch.manual_seed(11)
        model, optim = model_and_optim()
        ck = checkpointer(tmp_path / mode, async_save=mode == "async")
        train(model, optim, 2)
        save(ck, model, optim, 2)
        train(model, optim, 3)  # the optimizer's step pre-hook fences the first of these
        save(ck, model, optim, 5)
        train(model, optim, 2)
        ck.close()
        runs[mode] = (model, optim)
    assert logical_digest(tmp_path / "sync") == logical_digest(tmp_path / "async")

    # Resume from the async step 5: the RNG comes back too, so two more steps give exactly what
    # the uninterrupted run computed after its save.
    model2, optim2 = model_and_optim(seed=4)
    torch.manual_seed(99)
    restored = checkpointer(tmp_path / "async").restore(model=model2, optimizer=optim2)
    assert restored is not None and restored.step == 5
    train(model2, optim2, 2)
    assert state_equal(runs["async"][0], model2, runs["async"][1], optim2)
    assert state_equal(runs["sync"][0], runs["async"][0], runs["sync"][1], runs["async"][1])


def test_training_after_save_does_not_leak_into_the_checkpoint(
    tmp_path: Path, gate: tuple[threading.Event, list[str]]
) -> None:
    release, order = gate
    model, optim = model_and_optim()
    train(model, optim, 2)
    at_save = copy.deepcopy(model)
    optim_at_save = copy.deepcopy(optim)
    ck = checkpointer(tmp_path, async_save=True)
    save(ck, model, optim, 2)
    assert ck._writer.snapshot_pending and order == []  # parameters not copied yet
    forward_backward(model)  # changes the norm's running statistics (copied in save) and grads
    blocked_in_save = ck.stats.last_blocking_seconds
    ck._writer.clock = clock = FenceClock(release)  # releases the copy once the fence waits
    ck.wait_snapshot()  # the fence, called explicitly (the optimizer step's pre-hook calls it too)
    order.append("fenced")
    optim.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-3.0)  # mutations after the fence do not reach the checkpoint
    ck.close()
    assert order == ["copied", "fenced"]
    assert ck.stats.saves_total == 1 and read_latest(tmp_path) == "step-00000002"
    assert clock.fence_started.is_set()
    # the fence's wait (on the writer's clock) counts as blocking, added to the save's own
    assert ck.stats.last_blocking_seconds == blocked_in_save + FenceClock.WAIT_S

    model2, optim2 = model_and_optim(seed=9)
    assert checkpointer(tmp_path).restore(model=model2, optimizer=optim2) is not None
    assert state_equal(at_save, model2, optim_at_save, optim2)


def test_the_optimizer_step_fences_a_caller_that_forgot(
    tmp_path: Path, gate: tuple[threading.Event, list[str]]
) -> None:
    release, order = gate
    model, optim = model_and_optim()
    train(model, optim, 1)
    at_save, optim_at_save = copy.deepcopy(model), copy.deepcopy(optim)
    ck = checkpointer(tmp_path, async_save=True)
    save(ck, model, optim, 1)
    ck._writer.clock = clock = FenceClock(release)  # the copy runs only once a fence waits for it
    train(model, optim, 1)  # no wait_snapshot(): the step pre-hook waits for the copy
    order.append("stepped")
    ck.close()
    assert clock.fence_started.is_set() and order == ["copied", "stepped"]
    assert ck.stats.blocking_seconds_total >= FenceClock.WAIT_S  # the hook's wait counted too
    model2, optim2 = model_and_optim(seed=9)
    checkpointer(tmp_path).restore(model=model2, optimizer=optim2)
    assert state_equal(at_save, model2, optim_at_save, optim2)


@pytest.mark.parametrize("async_save", [False, True])
def test_the_fence_is_a_no_op_with_nothing_pending(tmp_path: Path, async_save: bool) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path, async_save=async_save)
    ck.wait_snapshot()  # nothing saved yet
    assert ck.stats.blocking_seconds_total == 0.0
    save(ck, model, optim, 1)
    ck.wait_snapshot()
    assert not ck._writer.snapshot_pending
    total = ck.stats.blocking_seconds_total
    for _ in range(3):
        ck.wait_snapshot()  # already fenced (or a sync save): nothing to wait for, nothing counted
    assert ck.stats.blocking_seconds_total == total
    ck.close()
    assert ck.stats.saves_total == 1


def test_a_failed_snapshot_copy_aborts_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path, async_save=True)
    save(ck, model, optim, 1)
    ck.close()
    original = SnapshotBuffers.copy

    def broken(self: SnapshotBuffers, items: list) -> list:  # type: ignore[type-arg]
        if threading.current_thread().name == WRITER:
            raise RuntimeError("copy failed")
        return original(self, items)

    monkeypatch.setattr(SnapshotBuffers, "copy", broken)
    train(model, optim, 1)
    save(ck, model, optim, 2)
    ck.wait_snapshot()  # the fence opens although the copy failed
    ck.close()
    assert ck.stats.aborts_total == 1 and read_latest(tmp_path) == "step-00000001"
    assert not list(tmp_path.glob(".staging-*"))
    monkeypatch.setattr(SnapshotBuffers, "copy", original)
    save(ck, model, optim, 3)
    ck.close()
    assert ck.stats.saves_total == 2 and read_latest(tmp_path) == "step-00000003"


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="per-thread priority is a Linux feature")
def test_the_writer_lowers_only_its_own_priority() -> None:
    seen: list[int] = []

    def writer() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_priority(10)
        seen.extend([before, os.getpriority(os.PRIO_PROCESS, tid)])

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    thread = threading.Thread(target=writer)
    thread.start()
    thread.join()
    assert seen[1] == min(19, seen[0] + 10)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # training's is unchanged


def test_failpoint_before_the_background_write_aborts_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, optim = model_and_optim()
    ck = checkpointer(tmp_path, async_save=True)
    save(ck, model, optim, 1)
    ck.close()
    monkeypatch.setenv(failpoints.ENV, "async_before_write=enospc")
    train(model, optim, 1)
    save(ck, model, optim, 2)
    ck.close()
    assert ck.stats.aborts_total == 1 and read_latest(tmp_path) == "step-00000001"
    assert not list(tmp_path.glob(".staging-*"))
