"""Start-up of a worker group: a store prefix for this round, and a bound on every start-up wait.

:func:`agree_round` gives every rank of a newly started worker group the same fresh token, which
no earlier group on the same store used, even when that store still holds an earlier group's
keys (torchrun's agent store outlives the workers: see :mod:`worker.start.dist`). It uses only
``set``, ``get``, ``check``, ``wait`` and ``delete_key``, so it runs on a ``torch.distributed``
Store and, in the unit tests, on :class:`worker.checkpoint.coordinator.MemoryStore`.

The protocol. Rank 0 draws the token ``T``; each other rank ``r`` draws a nonce ``n`` and writes
it to ``hello/r``. Rank 0 answers whatever ``hello/r`` holds by writing ``T`` to ``reply/<n>``,
and answers again whenever ``hello/r`` changes; rank ``r`` reads ``reply/<its own n>``, a key
nobody else can name, then writes ``T/joined/r``. Rank 0 is done when every rank has joined
under ``T``, a key nobody else can name either. A stale ``hello/r`` (a dead process's nonce)
only earns a reply nobody reads, and a stale ``reply`` or ``joined`` key is never looked at, so
no rank can take an earlier round's token and no leftover can make rank 0 stop early.

:class:`Watchdog` bounds start-up as a whole: whatever it waits in (a store connection, the
round, the process group's creation, a broadcast), the process writes one line naming the wait
and its length and exits 1 (torchrun's restart then applies) instead of hanging.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from types import TracebackType

from worker.checkpoint.coordinator import KeyValueStore, wait_keys
from worker.errors import ElastrainError

GRACE_S = 1.0  # the watchdog fires this long after the deadline the waits themselves honour


class StartupTimeout(ElastrainError):
    """A start-up wait ran out; the message says what was waited for and for how long."""


def agree_round(
    store: KeyValueStore,
    *,
    rank: int,
    world_size: int,
    base: str,
    timeout_s: float,
    poll_s: float = 0.02,
    new_token: Callable[[], str] = lambda: uuid.uuid4().hex,
) -> str:
    """The token every rank of this group returns (see the module docstring); keys under ``base``.

    Raises :class:`StartupTimeout` after ``timeout_s`` seconds naming what did not arrive."""
    deadline = time.monotonic() + timeout_s
    if world_size == 1:
        return new_token()
    if rank == 0:
        return _lead(
            store, world_size=world_size, base=base, token=new_token(), deadline=deadline, poll_s=poll_s
        )
    return _follow(store, rank=rank, base=base, nonce=new_token(), deadline=deadline, timeout_s=timeout_s)


def _follow(
    store: KeyValueStore, *, rank: int, base: str, nonce: str, deadline: float, timeout_s: float
) -> str:
    store.set(f"{base}/hello/{rank}", nonce)
    reply = f"{base}/reply/{nonce}"
    if not wait_keys(store, [reply], deadline - time.monotonic()):
        raise StartupTimeout(
            f"waited {seconds(timeout_s)} for rank 0 to answer (agreeing on this round's store prefix)"
        )
    token = store.get(reply).decode()
    store.delete_key(reply)
    store.set(f"{base}/{token}/joined/{rank}", "1")
    return token


def _lead(
    store: KeyValueStore, *, world_size: int, base: str, token: str, deadline: float, poll_s: float
) -> str:
    started = time.monotonic()
    answered: dict[int, str] = {}  # rank -> the nonce answered last
    pending = set(range(1, world_size))
    while True:
        for r in sorted(pending):
            _answer(store, rank=r, base=base, token=token, answered=answered)
        joined = {r: f"{base}/{token}/joined/{r}" for r in pending}
        wait_keys(store, list(joined.values()), min(poll_s, max(deadline - time.monotonic(), 0.0)))
        pending = {r for r, key in joined.items() if not store.check([key])}
        if not pending:
            break
        if time.monotonic() >= deadline:
            raise StartupTimeout(
                f"waited {seconds(time.monotonic() - started)} for ranks {_ranks(pending)} to join "
                "(agreeing on this round's store prefix)"
            )
    for r in range(1, world_size):
        store.delete_key(f"{base}/{token}/joined/{r}")
    return token


def _answer(store: KeyValueStore, *, rank: int, base: str, token: str, answered: dict[int, str]) -> None:
    hello = f"{base}/hello/{rank}"
    if not store.check([hello]):
        return
    nonce = store.get(hello).decode()
    if answered.get(rank) == nonce:
        return
    if rank in answered:  # that one was stale: nobody will read its reply
        store.delete_key(f"{base}/reply/{answered[rank]}")
    store.set(f"{base}/reply/{nonce}", token)
    answered[rank] = nonce


def seconds(value: float) -> str:
    """``0.3 s``, ``12 s``, ``300 s``: for the lines a person reads."""
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def _ranks(ranks: set[int]) -> str:
    shown = sorted(ranks)
    return ", ".join(map(str, shown[:8])) + (f" and {len(shown) - 8} more" if len(shown) > 8 else "")


def exit_now(message: str) -> None:
    """The default expiry: the line on stderr, then exit 1 at once (the main thread may be stuck
    in C++ that no exception reaches)."""
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    os._exit(1)


class Watchdog:
    """Calls ``on_expire(line)`` if the ``with`` block has not ended ``timeout_s`` (+ a grace of
    :data:`GRACE_S`) after it began. :meth:`stage` names the current wait for that line and
    returns the seconds left, which the wait should use as its own timeout."""

    def __init__(
        self,
        timeout_s: float,
        *,
        rank: int,
        on_expire: Callable[[str], None] = exit_now,
        grace_s: float = GRACE_S,
    ) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.on_expire = on_expire
        self.grace_s = grace_s
        self._what = "start-up"
        self._since = self._started = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="elastrain-startup-watchdog", daemon=True)

    def stage(self, what: str) -> float:
        self._what, self._since = what, time.monotonic()
        return self.remaining()

    def remaining(self) -> float:
        return max(self._started + self.timeout_s - time.monotonic(), 0.001)

    def line(self) -> str:
        now = time.monotonic()
        return (
            f"elastrain worker (rank {self.rank}): error: waited {seconds(now - self._since)} for "
            f"{self._what}; start-up gave up after {seconds(now - self._started)} "
            f"(ELASTRAIN_COLLECTIVE_TIMEOUT_S={self.timeout_s:g})"
        )

    def failed(self, exc: BaseException) -> StartupTimeout:
        """The error for a wait that failed by itself (a torch timeout): the stage and the cause."""
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]
        return StartupTimeout(f"waited {seconds(time.monotonic() - self._since)} for {self._what}: {cause}")

    def _watch(self) -> None:
        if not self._done.wait(self.timeout_s + self.grace_s):
            self.on_expire(self.line())

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        self._thread.join()
