"""Timing gradient communication through a DDP comm hook, and peak memory (torch imported lazily)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class CommTimer:
    """A DDP communication hook that all-reduces as DDP's built-in one does (mean by multiplying
    with 1/W) and times it. Bit-identical to the built-in reduction when gradients are set to
    None between steps (the trainer's ``zero_grad(set_to_none=True)``); gradients that persist
    as bucket views are divided in place by DDP instead, which can differ in the last bit.
    *Exposed* time is from the moment the last bucket is launched (backward compute is over)
    until every bucket of that backward has been reduced: the wait nothing overlaps. Register
    before the first backward: ``ddp.register_comm_hook(None, timer.hook)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._exposed = self._total = 0.0
        self._pending = 0
        self._last_launch: float | None = None
        self._done = 0.0
        self.hook = self._unannotated_hook()

    def _unannotated_hook(self) -> Callable[[Any, Any], Any]:
        """DDP checks a hook's annotations against ``dist.GradBucket``/``Future``; this module's
        annotations are strings (``from __future__``), so the hook carries none."""

        def hook(process_group: Any, bucket: Any) -> Any:
            return self._launch(process_group, bucket)

        hook.__annotations__ = {}
        return hook

    def _launch(self, process_group: Any, bucket: Any) -> Any:
        import torch.distributed as dist

        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None, "the DDP comm hook runs inside an initialised process group"
        start = time.perf_counter()
        tensor = bucket.buffer()
        tensor.mul_(1.0 / group.size())
        with self._lock:
            if bucket.index() == 0:
                self._last_launch, self._done = None, start
            self._pending += 1
            if bucket.is_last():
                self._last_launch = start
        future = dist.all_reduce(tensor, group=group, async_op=True).get_future()

        def finished(fut: Any) -> Any:
            end = time.perf_counter()
            with self._lock:
                self._total += end - start
                self._pending -= 1
                self._done = max(self._done, end)
                if self._pending == 0 and self._last_launch is not None:
                    self._exposed += max(0.0, self._done - self._last_launch)
                    self._last_launch = None
            return fut.value()[0]

        return future.then(finished)

    def take(self) -> tuple[float, float]:
        """(exposed, total) seconds since the previous call."""
        with self._lock:
            out, self._exposed, self._total = (self._exposed, self._total), 0.0, 0.0
            return out


def peak_memory_bytes(device: str) -> int:
    """The device allocator's peak on CUDA; the process's max resident set size on CPU."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
