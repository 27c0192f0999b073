"""A ``torch.distributed.Store`` kept in etcd v3: the c10d store of the etcd-v3 rendezvous.

torchrun's agents use it once per rendezvous round (through a ``PrefixStore`` named after the
round): rank 0 publishes ``MASTER_ADDR``/``MASTER_PORT`` for the worker group, the agents
exchange their role infos and worker ranks, and at the end they meet at an exit barrier. The
workers themselves never use it (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: worker rank 0 hosts
a fresh TCPStore per attempt).

Semantics match ``TCPStore``: ``get`` and ``wait`` block until every key exists or the store's
timeout passes (then :class:`torch.distributed.DistStoreError`); ``add`` keeps a decimal
counter and is atomic (compare-and-set on ``mod_revision``, never replayed on another member);
``compare_set`` writes ``desired`` iff the value is ``expected`` (or the key is absent and
``expected`` is empty) and returns the value now stored (``expected`` if the key is absent).
A zero or negative timeout waits forever, like c10d's ``kNoTimeout``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import ParamSpec, TypeVar

import torch.distributed as dist

from service.rendezvous.kv import EtcdKV
from worker.etcdclient import EtcdRefusedError, EtcdUnavailableError

T = TypeVar("T")
P = ParamSpec("P")

_POLL_FIRST_S = 0.005
_POLL_MAX_S = 0.1


def add_value(current: bytes | None, amount: int) -> tuple[bytes, int]:
    """The counter after adding ``amount``: (bytes to store, new value). Pure."""
    try:
        base = int(current.decode("ascii")) if current else 0
    except (UnicodeDecodeError, ValueError):
        raise dist.DistStoreError(f"add() on a key that holds {current!r}, not a number") from None
    total = base + amount
    return str(total).encode("ascii"), total


def compare_set_outcome(current: bytes | None, expected: bytes, desired: bytes) -> tuple[bool, bytes]:
    """TCPStore's compare_set rule: (write ``desired``?, value to return). Pure."""
    if current is None:
        return (True, desired) if expected == b"" else (False, expected)
    if current == expected:
        return True, desired
    return False, current


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


class EtcdV3Store(dist.Store):
    """A c10d store whose keys live under ``prefix`` in etcd; usable from any node, owned by none."""

    def __init__(self, kv: EtcdKV, prefix: str, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._kv = kv
        self._prefix = prefix
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        self._io(self._kv.put, self._key(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        found = self._io(self._kv.get, self._key(key))
        if found is None:  # deleted between the wait and the read
            raise dist.DistStoreError(f"key {key!r} was deleted while being read")
        return found.value

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        while True:
            current = self._io(self._kv.get, full)
            new, total = add_value(current.value if current else None, amount)
            revision = current.mod_revision if current else None
            written, _ = self._io(self._kv.cas, full, new, revision, replay_safe=False)
            if written:
                return total

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        full = self._key(key)
        want, new = _as_bytes(expected), _as_bytes(desired)
        while True:
            current = self._io(self._kv.get, full)
            write, result = compare_set_outcome(current.value if current else None, want, new)
            if not write:
                return result
            revision = current.mod_revision if current else None
            written, _ = self._io(self._kv.cas, full, new, revision)
            if written:
                return result

    def check(self, keys: list[str]) -> bool:
        return self._io(self._kv.all_exist, [self._key(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = (timeout if timeout is not None else self.timeout).total_seconds()  # type: ignore[attr-defined]
        deadline = time.monotonic() + limit if limit > 0 else None
        pause = _POLL_FIRST_S
        while not self.check(keys):
            if deadline is not None and time.monotonic() >= deadline:
                raise dist.DistStoreError(
                    f"wait timeout after {limit:g}s for keys {keys} in the etcd-v3 rendezvous store"
                )
            time.sleep(pause if deadline is None else min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(pause * 2, _POLL_MAX_S)

    def getNumKeys(self) -> int:  # the name c10d's Python trampoline calls
        return self._io(self._kv.count, self._prefix)

    def deleteKey(self, key: str) -> bool:  # the name c10d's Python trampoline calls
        return self._io(self._kv.delete, self._key(key))

    def num_keys(self) -> int:
        return self.getNumKeys()

    def delete_key(self, key: str) -> bool:
        return self.deleteKey(key)

    @staticmethod
    def _io(call: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return call(*args, **kwargs)
        except EtcdRefusedError as exc:
            raise dist.DistStoreError(f"etcd refused a store operation: {exc.detail}") from exc
        except EtcdUnavailableError as exc:
            raise dist.DistStoreError(str(exc)) from exc
