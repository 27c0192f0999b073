"""Coordinators: who collects the ranks' reports and publishes or aborts (torch-free).

:class:`Coordinator` is the small interface the engine calls; :class:`InJobCoordinator` is the
implementation for a worker under bare torchrun: ranks put their reports into the
torch.distributed Store under ``elastrain/ckpt/<job>/<session>/g<generation>/n<seq>/s<step>/``
(``session`` tells apart checkpointers created one after another in one generation), rank 0
waits for all ``world_size`` reports (failing fast on a failure report), runs the pure
:func:`worker.checkpoint.commit.decide`, publishes or aborts, and writes the outcome back so the
other ranks learn it; it then deletes the reports (they can be large). The store is used only
through ``set``, ``get``, ``check``, ``wait``, ``add`` and ``delete_key``, which work from a
background thread (unlike collectives on the training process group).

The generation is the number the worker group agreed on when it formed
(:func:`worker.start.dist.agree_generation`: rank 0's clock in milliseconds, broadcast), so every
group of a job has its own and all its ranks share it. It is not ``TORCHELASTIC_RESTART_COUNT``:
each torchrun agent counts its own restarts, and an agent that joined later counts differently.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Protocol

from worker.checkpoint.commit import (
    Expected,
    Report,
    build_manifest,
    decide,
    report_from_json,
    report_to_json,
)
from worker.checkpoint.places import Place, abort_staged, publish_staged, staged_sizes, staging_of
from worker.errors import ElastrainError


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a save: published (and where) or aborted (and why)."""

    published: bool
    step: int
    generation: int
    reason: str
    path: str | None = None


class Coordinator(Protocol):
    def report(self, report: Report, *, seq: int) -> None:
        """Hand this rank's phase-1 report over (never blocks for long)."""

    def outcome(self, step: int, generation: int, *, seq: int, timeout: float) -> Outcome:
        """Block until the save is published or aborted (at most ``timeout`` seconds plus the
        time publishing takes); every rank calls it."""


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` used here."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Block until every key exists; raise (any exception) after ``timeout``."""

    def add(self, key: str, amount: int) -> int: ...

    def delete_key(self, key: str) -> bool: ...


class MemoryStore:
    """An in-process :class:`KeyValueStore` (a world of one, and tests)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._lock:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)
            self._lock.notify_all()

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        with self._lock:
            if not self._lock.wait_for(lambda: all(k in self._data for k in keys), timeout.total_seconds()):
                raise TimeoutError(f"keys {keys} not set within {timeout}")

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._lock.notify_all()
            return value

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None


def session_id(store: KeyValueStore, *, job: str, generation: int, world_size: int) -> str:
    """A name every rank computes alike for the n-th checkpointer created in this generation
    (all ranks create theirs in the same order): each rank adds 1 to one counter."""
    n = store.add(f"elastrain/ckpt/{job}/g{generation}/sessions", 1)
    return f"s{(n - 1) // world_size}"


def wait_keys(store: KeyValueStore, keys: list[str], seconds: float) -> bool:
    """Whether all ``keys`` exist within ``seconds`` (a blocking wait in the store, no polling)."""
    try:
        store.wait(keys, timedelta(seconds=max(seconds, 0.001)))
    except Exception:  # torch raises DistStoreError on timeout, or an error if the store is gone
        return store.check(keys)
    return True


def wait_for(store: KeyValueStore, key: str, *, timeout: float) -> bytes | None:
    """The value of ``key`` once it exists, or None after ``timeout`` seconds."""
    return store.get(key) if wait_keys(store, [key], timeout) else None


def store_allgather(
    store: KeyValueStore, prefix: str, *, rank: int, world_size: int, value: str, timeout: float
) -> list[str]:
    """Every rank's ``value`` for a one-off agreement (restore). Raises ElastrainError on timeout."""
    store.set(f"{prefix}/{rank}", value)
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    if not wait_keys(store, keys, timeout):
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise ElastrainError(f"ranks {missing} did not answer within {timeout:.0f} s ({prefix})")
    return [store.get(k).decode() for k in keys]


class InJobCoordinator:
    """Rank 0 of the job coordinates through the rendezvous Store (see the module docstring)."""

    def __init__(
        self, store: KeyValueStore, *, rank: int, world_size: int, job: str, job_dir: Place,
        session: str = "s0", poll: float = 0.1, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        """``clock``: what the reports' deadline is measured on (tests inject one, so that
        whether the deadline has passed is decided by the test, not by how fast threads run)."""
        self.store = store
        self.clock = clock
        self.session = session
        self.rank = rank
        self.world_size = world_size
        self.job = job
        self.job_dir = job_dir
        self.poll = poll

    def _prefix(self, step: int, generation: int, seq: int) -> str:
        return f"elastrain/ckpt/{self.job}/{self.session}/g{generation}/n{seq}/s{step}"

    def report(self, report: Report, *, seq: int) -> None:
        key = f"{self._prefix(report.step, report.generation, seq)}/report/{report.rank}"
        self.store.set(key, report_to_json(report))

    def outcome(self, step: int, generation: int, *, seq: int, timeout: float) -> Outcome:
        prefix = self._prefix(step, generation, seq)
        if self.rank != 0:
            raw = wait_for(self.store, f"{prefix}/outcome", timeout=timeout + 60.0)
            if raw is None:
                return Outcome(
                    False, step, generation, f"no outcome from rank 0 within {timeout + 60.0:.0f} s"
                )
            return Outcome(**json.loads(raw))
        result = self._coordinate(step, generation, prefix, timeout)
        self.store.set(f"{prefix}/outcome", json.dumps(asdict(result)))
        return result

    def _coordinate(self, step: int, generation: int, prefix: str, timeout: float) -> Outcome:
        expected = Expected(step, generation, self.world_size)
        staging = staging_of(self.job_dir, step, generation)
        deadline = self.clock() + timeout
        reports: dict[int, Report] = {}
        keys = [f"{prefix}/report/{r}" for r in range(self.world_size)]
        while True:
            # Block until all reports are in, but look at partial ones every `poll` seconds so
            # that a failure report aborts at once.
            wait_keys(self.store, [keys[r] for r in range(self.world_size) if r not in reports], self.poll)
            for r in range(self.world_size):
                key = f"{prefix}/report/{r}"
                if r not in reports and self.store.check([key]):
                    raw = self.store.get(key)
                    self.store.delete_key(key)  # reports can be large; only rank 0 reads them
                    try:
                        reports[r] = report_from_json(raw)
                    except ValueError as exc:
                        return self._abort(staging, step, generation, f"rank {r}: {exc}")
            decision = decide(
                expected,
                list(reports.values()),
                deadline_passed=self.clock() >= deadline,
                observed_sizes=staged_sizes(staging) if len(reports) == self.world_size else None,
            )
            if decision.action == "abort":
                return self._abort(staging, step, generation, decision.reason)
            if decision.action == "publish":
                break
        try:
            manifest = build_manifest(expected, list(reports.values()))
            path = publish_staged(self.job_dir, staging, manifest)
        except (OSError, ElastrainError) as exc:
            return self._abort(staging, step, generation, f"publishing failed: {exc}")
        return Outcome(True, step, generation, decision.reason, str(path))

    def _abort(self, staging: Place, step: int, generation: int, reason: str) -> Outcome:
        try:
            abort_staged(staging, reason)
        except (OSError, ElastrainError) as exc:
            reason = f"{reason}; removing the staging directory failed too: {exc}"
        return Outcome(False, step, generation, reason)
