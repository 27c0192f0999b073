"""Async saves: snapshot into reusable, pre-touched CPU buffers, persist on a background thread.

Training blocks only for the snapshot (a memcpy of the rows this rank writes). At most one save
is in flight: :meth:`AsyncWriter.submit` first waits for the previous one. The thread is not a
daemon, so the interpreter cannot exit while a save is being published or aborted.

Why a thread and not a process: hashing (xxhash), writes and fsync all release the GIL, so the
background work competes with training only for CPU and disk bandwidth, which a process would
compete for too; ``benchmarks/checkpoint_async.py`` measures both.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from worker.checkpoint.saveplan import Assignment

log = logging.getLogger("elastrain.checkpoint")

_Key = tuple[str, int, int, torch.dtype, tuple[int, ...]]


class SnapshotBuffers:
    """CPU buffers keyed by (tensor, rows, dtype, shape), reused across saves; new ones are
    zero-filled once so their pages are resident before the first copy."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, torch.Tensor] = {}
        self.allocated_bytes = 0

    def snapshot(self, items: list[tuple[Assignment, torch.Tensor]]) -> list[tuple[Assignment, torch.Tensor]]:
        pin = torch.cuda.is_available()
        used: dict[_Key, torch.Tensor] = {}
        out = []
        for a, src in items:
            key = (a.name, a.start, a.stop, src.dtype, tuple(src.shape))
            buf = self._buffers.get(key)
            if buf is None:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
                buf.zero_()
                self.allocated_bytes += buf.numel() * buf.element_size()
            buf.copy_(src, non_blocking=pin)
            used[key] = buf
            out.append((a, buf))
        if pin:
            torch.cuda.synchronize()
        self._buffers = used  # drop buffers for tensors that are gone
        return out


class AsyncWriter:
    """Runs one background persist at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.buffers = SnapshotBuffers()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def submit(self, work: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                work()
            except BaseException:  # a bug in the writer must not vanish with its thread
                log.exception("background checkpoint writer failed")

        self._thread = threading.Thread(target=run, name="elastrain-checkpoint-writer", daemon=False)
        self._thread.start()
