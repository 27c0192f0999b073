"""This rank's micro-batches, in the sampler's exact order: loaded ahead on a background thread.

The sampler is a pure function of a small state (:mod:`worker.datapath.sampler`), so the windows to come
are known in advance: from the state before a window, the feed plans that window and the ones
after it and calls ``batch()`` for this rank's share of each micro-step, ``data.prefetch``
micro-batches ahead of the step, on one background thread (one call at a time, in order). The
training thread takes them in the same order and checks that each is the one it asked for; a
batch it did not ask for (a request from another state) restarts the loading from there. Nothing
loaded ahead is part of the run's state: the sampler state a checkpoint holds is the trainer's
(the state after the last window trained), so it names exactly the next sample, and batches
loaded past it are dropped. A ``batch()`` that raises stops the run with its own error, raised on
the training thread when the step reaches that batch (never for a batch the run does not train).

Randomness: a dataset whose ``batch()`` draws from the global generators (python ``random``,
numpy's, torch's: augmentation) would draw on the background thread, interleaved with the
training thread's dropout in whatever order the threads ran, and outside the streams a checkpoint
restores. :func:`probe` finds such a dataset before the run starts (generators compared before
and after two calls, then restored) and the trainer loads its batches on the training thread
instead, between micro-steps, as the prefetch depth 0 does: its draws stay in the checkpointed,
resumed streams. The same calls time ``batch()``: with ``data.prefetch`` unset, a fast one on CPU
is loaded between micro-steps too (:func:`choose_depth`).

On a GPU the loaded tensors are pinned on the background thread, so that the training thread's
``.to(device, non_blocking=True)`` is an asynchronous copy.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from worker.checkpoint.rng import capture_rng, restore_rng
from worker.datapath.datasets import Dataset
from worker.datapath.sampler import SamplerState, Window, indices, plan_window
from worker.datapath.trace import rng_fingerprint
from worker.train.objective import to_device

DEFAULT_DEPTH = 4
_STARVED_S = 5.0  # how often a starved training thread checks that the loader is alive


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-step's share of this rank: the dataset indices and what ``batch()`` gave for them."""

    indices: np.ndarray
    inputs: Any
    targets: Any


Key = tuple[SamplerState, int]
"""A micro-batch's place: the sampler state before its window, and its micro-step in the window."""


class Feed:
    """Loads this rank's micro-batches on the training thread (prefetch 0). See the module."""

    def __init__(
        self, data: Dataset, *, seed: int, rank: int, world_size: int, micro_batch: int,
        accum_steps: int, device: torch.device,
    ) -> None:  # fmt: skip
        self.data, self.seed, self.rank, self.world_size = data, seed, rank, world_size
        self.micro_batch, self.accum_steps, self.device = micro_batch, accum_steps, device
        self.size = len(data)
        self.wait_s = 0.0
        """Seconds the training thread waited for batches (loading them itself, at depth 0)."""

    def plan(self, state: SamplerState) -> Window:
        """The window that follows ``state`` (pure: every rank plans the same)."""
        return plan_window(
            state, dataset_size=self.size, world_size=self.world_size, micro_batch=self.micro_batch,
            accum_steps=self.accum_steps,
        )  # fmt: skip

    def load(self, window: Window, micro: int) -> MicroBatch:
        idx = indices(self.seed, window.epoch, self.size, window.micro_steps[micro].bounds[self.rank])
        inputs, targets = self.data.batch(idx)
        return MicroBatch(idx, inputs, targets)

    def batches(self, state: SamplerState, window: Window) -> Iterator[MicroBatch]:
        """This rank's micro-batches of ``window`` (planned from ``state``), on the device, in order."""
        for micro in range(len(window.micro_steps)):
            started = time.perf_counter()
            got = self._take((state, micro), window)
            inputs, targets = to_device(got.inputs, self.device), to_device(got.targets, self.device)
            self.wait_s += time.perf_counter() - started
            yield MicroBatch(got.indices, inputs, targets)

    def _take(self, key: Key, window: Window) -> MicroBatch:
        return self.load(window, key[1])

    def close(self) -> None:
        """Stop loading (idempotent); nothing to do on the training thread."""


class PrefetchFeed(Feed):
    """Loads ``depth`` micro-batches ahead on a background thread (see the module)."""

    def __init__(self, data: Dataset, *, depth: int = DEFAULT_DEPTH, **kwargs: Any) -> None:
        super().__init__(data, **kwargs)
        if depth < 1:
            raise ValueError("a prefetch depth is at least 1 (0 loads on the training thread)")
        self.depth = depth
        self.pin = self.device.type == "cuda"
        self._loader: _Loader | None = None

    def _take(self, key: Key, window: Window) -> MicroBatch:
        if self._loader is None or self._loader.next_key != key:
            # The first batch, or the trainer asks from another state than the one loaded ahead
            # (it asks for a window's micro-steps in order, so key is a window's first here).
            self.close()
            self._loader = _Loader(self, key[0], self.depth)
        got_key, got = self._loader.get()
        if got_key != key:  # pragma: no cover - the loader loads in the order it is asked
            raise AssertionError(f"the data loader gave micro-batch {got_key}, not {key}")
        if isinstance(got, BaseException):
            raise got  # the user's own error, as batch() raised it
        return got

    def close(self) -> None:
        if self._loader is not None:
            self._loader.stop()
            self._loader = None


Item = tuple[Key, Key, MicroBatch | BaseException]
"""What the loader hands over: the micro-batch's key, the key after it, and the batch (or the
error loading it raised)."""


class _Buffer:
    """The loader's bounded buffer. Once full, the loader sleeps until the training thread has taken
    half of it, then refills: one wake-up of the loader per ``depth // 2`` micro-batches, not one
    per micro-batch (each wake-up of a thread costs a context switch on cores the ranks share)."""

    def __init__(self, depth: int) -> None:
        self.items: collections.deque[Item] = collections.deque()
        self.depth, self.low = depth, depth // 2
        self.cond = threading.Condition(threading.Lock())
        self.stopped = False
        self._loader_waits = False
        self.loader_wakeups = 0
        """Times the loader woke from waiting on a full buffer."""

    def put(self, item: Item) -> bool:
        """Add ``item``; when full, wait until half is taken. False once stopped."""
        with self.cond:
            if self.stopped:
                return False
            self.items.append(item)
            self.cond.notify_all()  # a training thread waiting for it
            if len(self.items) >= self.depth:
                self._loader_waits = True
                while len(self.items) > self.low and not self.stopped:
                    self.cond.wait()
                    self.loader_wakeups += 1
                self._loader_waits = False
            return not self.stopped

    def get(self, timeout: float) -> Item | None:
        """The oldest item, waiting up to ``timeout`` seconds for one (None: none came)."""
        with self.cond:
            if not self.items and not self.cond.wait_for(lambda: bool(self.items), timeout):
                return None
            item = self.items.popleft()
            if self._loader_waits and len(self.items) <= self.low:
                self.cond.notify_all()
            return item

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.items.clear()
            self.cond.notify_all()


class _Loader:
    """One background thread loading from a sampler state on; once stopped it stays stopped."""

    def __init__(self, feed: PrefetchFeed, state: SamplerState, depth: int) -> None:
        self.feed = feed
        self.buffer = _Buffer(depth)
        self.next_key: Key = (state, 0)
        """The key of the micro-batch the training thread gets next."""
        self.thread = threading.Thread(target=self._run, args=(state,), name="elastrain-data", daemon=True)
        self.thread.start()

    def get(self) -> tuple[Key, MicroBatch | BaseException]:
        while True:
            got = self.buffer.get(timeout=_STARVED_S)
            if got is None:
                if self.thread.is_alive():
                    continue
                got = self.buffer.get(timeout=0)  # put just before the thread ended
                if got is None:
                    return self.next_key, RuntimeError("the data loading thread stopped without a batch")
            key, after, batch = got
            self.next_key = after
            return key, batch

    def _run(self, state: SamplerState) -> None:
        feed = self.feed
        if feed.pin:  # pin through this rank's device's context, not device 0's (as DataLoader does)
            torch.cuda.set_device(feed.device)
        while True:
            window = feed.plan(state)
            last = len(window.micro_steps) - 1
            for micro in range(last + 1):
                after = (state, micro + 1) if micro < last else (window.after, 0)
                try:
                    item = feed.load(window, micro)
                    if feed.pin:
                        item = _pinned(item)
                except BaseException as exc:  # handed to the training thread and raised there
                    self.buffer.put(((state, micro), after, exc))
                    return
                if not self.buffer.put(((state, micro), after, item)):
                    return
            state = window.after

    def stop(self) -> None:
        """Stop loading: the thread ends after the batch it is loading (a daemon: a batch() that
        never returns does not keep the process alive)."""
        self.buffer.stop()
        self.thread.join(timeout=1.0)


def _pinned(batch: MicroBatch) -> MicroBatch:
    return MicroBatch(batch.indices, _pin(batch.inputs), _pin(batch.targets))


def _pin(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _pin(v) for k, v in value.items()}
    return value.pin_memory() if isinstance(value, torch.Tensor) else value


AUTO_MIN_BATCH_S = 1e-3
"""With ``data.prefetch`` unset on CPU, a ``batch()`` faster than this is loaded between micro-steps."""

RANDOM_BATCH_NOTE = (
    "data.prefetch: batch() draws from the global random generators, so batches are loaded on the "
    "training thread (not ahead), keeping its draws in the generator streams a checkpoint restores; "
    "draw from a generator of the dataset's own (seeded from the indices) to have them loaded ahead"
)


def probe(data: Dataset, count: int) -> tuple[bool, float]:
    """Load the first ``count`` samples twice: whether ``batch()`` draws from the global generators
    (python, numpy, torch, CUDA), and the faster call's seconds. Leaves every generator as it was."""
    before = capture_rng()
    seconds = []
    try:
        for _ in range(2):
            started = time.perf_counter()
            data.batch(np.arange(min(count, len(data))))
            seconds.append(time.perf_counter() - started)
    finally:
        after = capture_rng()
        restore_rng(before)
    return rng_fingerprint(after) != rng_fingerprint(before), min(seconds)


def choose_depth(
    requested: int | None, data: Dataset, *, count: int, device: torch.device
) -> tuple[int, tuple[str, ...]]:
    """How many micro-batches to load ahead, and the run record's note on why not when not.

    ``requested`` is ``data.prefetch``: 0 never loads ahead; a number loads that many ahead. Unset:
    :data:`DEFAULT_DEPTH` ahead on a GPU (the host has cores to spare while the device computes)
    and on CPU when a ``batch()`` takes :data:`AUTO_MIN_BATCH_S` or more (it waits for storage,
    or cores are free); a faster one is loaded between micro-steps, where a thread would cost more
    than it saves on cores the ranks fill (its wake-ups, and the GIL it holds when the OS
    preempts it). Either way, a ``batch()`` that draws from the global generators is loaded between
    micro-steps.
    """
    if requested == 0:
        return 0, ()
    draws, seconds = probe(data, count)
    if draws:
        return 0, (RANDOM_BATCH_NOTE,)
    if requested is not None:
        return requested, ()
    if device.type == "cuda" or seconds >= AUTO_MIN_BATCH_S:
        return DEFAULT_DEPTH, ()
    return 0, (
        f"data.prefetch unset: a batch() took {1e3 * seconds:.3f} ms on CPU, so batches are loaded "
        f"between micro-steps (ahead from {1e3 * AUTO_MIN_BATCH_S:g} ms; set data.prefetch to load "
        "them ahead anyway)",
    )


def make_feed(data: Dataset, *, depth: int, **kwargs: Any) -> Feed:
    """A :class:`PrefetchFeed` ``depth`` micro-batches deep, or a :class:`Feed` at depth 0."""
    return PrefetchFeed(data, depth=depth, **kwargs) if depth > 0 else Feed(data, **kwargs)
