"""``ELASTRAIN_TRACE_SAMPLES=DIR``: what each rank's data path actually loaded (a test aid).

The trainer passes the micro-batches the step takes through a :class:`LoadRecorder`, which
notes the indices of each one, as ``batch()`` returned it, when the step takes it: a trace says
what was fed to the model, not what the plan said, nor what was loaded ahead and never trained
on (see :mod:`worker.datapath.feed`). After each window the rank appends one JSON line to
``DIR/rank-<rank>-pid-<pid>.jsonl``: the generation, the step before the window, the epoch, the
world size, the indices in load order, a fingerprint of every generator's state (python,
numpy, torch CPU, CUDA) taken right before the window's first micro-step, the Unix time the
window ended (``t``: the join benchmark reads step times from it), and what the training thread
did over the window (its forward, backward and step): ``wall_s``, ``cpu_s`` (the thread's CPU
time) and ``runq_s`` (the time it was ready to run and waited for a core, from
``/proc/thread-self/schedstat``; None where that cannot be read); the rest of ``wall_s`` it
waited on something (a peer in a collective, a lock). Lines of windows that a failure rolled
back stay in the file: readers keep, per step, the newest generation's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


class LoadRecorder:
    """Notes the indices of every micro-batch the step takes, in order."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def record(self, batches: Iterable[Any]) -> Iterator[Any]:
        """Pass ``batches`` (each with its ``indices``) through, noting each as it is taken."""
        for micro in batches:
            self.loaded.extend(int(i) for i in micro.indices)
            yield micro

    def take(self) -> list[int]:
        loaded, self.loaded = self.loaded, []
        return loaded


def thread_clock() -> tuple[float, float, float | None]:
    """The calling thread's (wall, CPU, run-queue wait) clocks in seconds; the last is None
    where ``/proc/thread-self/schedstat`` cannot be read (not Linux)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            waited: float | None = int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        waited = None
    return time.perf_counter(), time.thread_time(), waited


def spent(since: tuple[float, float, float | None]) -> dict[str, float | None]:
    """``wall_s``, ``cpu_s`` and ``runq_s`` of the calling thread since ``since``
    (:func:`thread_clock`)."""
    now = thread_clock()
    runq = None if since[2] is None or now[2] is None else round(now[2] - since[2], 6)
    return {"wall_s": round(now[0] - since[0], 6), "cpu_s": round(now[1] - since[1], 6), "runq_s": runq}


def rng_fingerprint(state: dict[str, Any]) -> str:
    """A short digest of generator states as :func:`worker.checkpoint.rng.capture_rng` gives them
    (and as a checkpoint's ``rank_meta[rank]["rng"]`` holds them)."""
    raw = json.dumps(state, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(raw, digest_size=12).hexdigest()


class SampleTrace:
    """One rank's trace file."""

    def __init__(self, directory: str, rank: int) -> None:
        self.path = Path(directory) / f"rank-{rank}-pid-{os.getpid()}.jsonl"

    def write(self, **record: Any) -> None:
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
