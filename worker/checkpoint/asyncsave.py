"""Async saves: a pipelined snapshot into reusable CPU buffers, then a background persist.

The choice (CheckFreq's, Mohan et al., FAST'21): the snapshot is not taken while training
waits. :meth:`Checkpointer.save` captures what is small or what the next forward pass could
change (progress, RNG, loss scaler, LR and other optimizer hyper-parameters as JSON; module
buffers such as norm running statistics, which a training-mode forward or DDP's buffer broadcast
rewrites) synchronously, and hands the rest — parameters and optimizer state, which only the
optimizer step changes — to the writer thread, which copies them into the snapshot buffers
(``copy_`` releases the GIL) while training runs the next forward and backward. Before anything
mutates the saved tensors again the fence, :meth:`AsyncWriter.wait_snapshot`, blocks until the
copy is done: an optimizer step pre-hook the checkpointer registers runs it before every
``optimizer.step()``, and a restore, another save and close wait for the whole save. It is a
no-op when no copy is pending. The time spent in ``save`` plus the time blocked in the fence is
what the checkpointer reports as blocking. Gradients are not part of a checkpoint, so the
backward pass writing them does not race with the copy. For FSDP the tensors copied are the
local shards (``DTensor.to_local()``), which forward and backward only read.

Buffers are keyed by (tensor, rows, dtype, shape) and reused across saves; a new one is
zero-filled once (on the writer thread) so that its pages are resident before the copy.

At most one save is in flight: :meth:`AsyncWriter.submit` first waits for the previous one. The
thread is not a daemon, so the interpreter cannot exit while a save is being published or
aborted.

Once the snapshot is copied, the writer thread lowers its own CPU priority (nice +10): it is
background work, and where training and the writer contend for cores training should win.
Measured on the shared 2-core machine under load (small-MLP steps/s while a 200 MiB save
persists / idle, 6 alternating rounds): 0.51 at the same priority, 0.81 at +10; the persist took
longer (0.7-2.8 s instead of 0.2-0.9 s). With free cores the two are the same.

Why a thread and not a process: copying, hashing (xxhash), writes and fsync all release the GIL,
so the background work competes with training only for CPU and disk bandwidth, which a process
would compete for too; ``benchmarks/checkpoint_async.py`` measures both.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from worker.checkpoint.saveplan import Assignment

log = logging.getLogger("elastrain.checkpoint")

_Key = tuple[str, int, int, torch.dtype, tuple[int, ...]]
Items = list[tuple[Assignment, torch.Tensor]]


class SnapshotBuffers:
    """CPU buffers keyed by (tensor, rows, dtype, shape), reused across saves; new ones are
    zero-filled once so their pages are resident before the first copy."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, torch.Tensor] = {}
        self._used: dict[_Key, torch.Tensor] = {}
        self.allocated_bytes = 0

    def begin(self) -> None:
        """Start a snapshot: buffers not used by it are dropped at :meth:`end`."""
        self._used = {}

    def copy(self, items: Items) -> Items:
        """Copies of ``items`` in their buffers (the copy is complete when this returns)."""
        pin = torch.cuda.is_available()
        out = []
        devices = {src.device for _, src in items if src.device.type == "cuda"}
        for a, src in items:
            key = (a.name, a.start, a.stop, src.dtype, tuple(src.shape))
            buf = self._buffers.get(key)
            if buf is None:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
                buf.zero_()
                self.allocated_bytes += buf.numel() * buf.element_size()
                self._buffers[key] = buf
            buf.copy_(src, non_blocking=pin and src.device.type != "cpu")
            self._used[key] = buf
            out.append((a, buf))
        for device in devices:  # the writer thread's current device need not be the tensors'
            torch.cuda.synchronize(device)
        return out

    def end(self) -> None:
        self._buffers = self._used  # drop buffers for tensors that are gone


class Snapshot:
    """One save's snapshot: ``eager`` items are copied by :meth:`copy_eager` (in ``save``), the
    others by :meth:`finish` (on the writer thread). :attr:`items` keeps the original order."""

    def __init__(
        self, buffers: SnapshotBuffers, items: Items, *, eager: Callable[[torch.Tensor], bool]
    ) -> None:
        self._buffers = buffers
        self._items = items
        self._eager = [i for i, (_, t) in enumerate(items) if eager(t)]
        self._done = threading.Event()
        self.items: Items = []
        self.error: Exception | None = None

    def copy_eager(self) -> None:
        self._buffers.begin()
        self.items = list(self._items)
        copies = self._buffers.copy([self._items[i] for i in self._eager])
        for i, copied in zip(self._eager, copies, strict=True):
            self.items[i] = copied

    def finish(self) -> None:
        """Copy the deferred items; whatever happens, the fence opens. A failure is kept in
        :attr:`error` (the persist then reports it, so the save is aborted on every rank)."""
        try:
            eager = set(self._eager)
            rest = [i for i in range(len(self._items)) if i not in eager]
            copies = self._buffers.copy([self._items[i] for i in rest])
            for i, copied in zip(rest, copies, strict=True):
                self.items[i] = copied
            self._buffers.end()
        except Exception as exc:
            log.exception("copying the checkpoint snapshot failed")
            self.error = exc
        finally:
            self._items = []  # no reference to live tensors once copied
            self._done.set()

    def wait(self) -> None:
        self._done.wait()


WRITER_NICE = 10  # how much lower than training the writer runs once the snapshot is copied


def lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux: a thread is a task of its
    own); where that is not possible the thread runs as it is."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:
        log.info("could not lower the checkpoint writer's priority: %s", exc)


class AsyncWriter:
    """Runs one background persist at a time, after the snapshot it copies."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._pending: Snapshot | None = None
        self.buffers = SnapshotBuffers()
        self.clock: Callable[[], float] = time.perf_counter  # what the fence's wait is measured on

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def snapshot_pending(self) -> bool:
        return self._pending is not None

    def wait_snapshot(self) -> float:
        """The fence: block until the pending snapshot's copy is done; returns the seconds
        blocked (0.0, at once, when none is pending)."""
        pending = self._pending
        if pending is None:
            return 0.0
        t0 = self.clock()
        pending.wait()
        self._pending = None
        return self.clock() - t0

    def wait(self) -> None:
        """Block until the save in flight (snapshot and persist) is finished."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._pending = None

    def submit(self, work: Callable[[], None], *, snapshot: Snapshot | None = None) -> None:
        """Run ``snapshot.finish()`` (if given), then ``work`` on the writer thread."""
        self.wait()

        def run() -> None:
            try:
                if snapshot is not None:
                    snapshot.finish()
                lower_priority(WRITER_NICE)
                work()
            except BaseException:  # a bug in the writer must not vanish with its thread
                log.exception("background checkpoint writer failed")

        self._pending = snapshot
        self._thread = threading.Thread(target=run, name="elastrain-checkpoint-writer", daemon=False)
        self._thread.start()
