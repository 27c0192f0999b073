"""The house rule for ``tests/unit``: a unit test opens no sockets and starts no processes.

Every unit test runs with the ways Python code reaches the network or starts a process replaced
by a tripwire: connecting, binding or listening on a socket (``socket.socket.connect``,
``connect_ex``, ``bind``, ``listen``; what ``socket.create_connection``, http clients, uvicorn
use), and starting a process (``subprocess``, and ``multiprocessing`` through
``_posixsubprocess.fork_exec``, ``os.fork``, ``os.forkpty``, ``os.posix_spawn[p]``,
``os.system``). A tripped wire raises at once (a ``BaseException``, so ``except Exception`` or
``except OSError`` cannot swallow it) and fails the test at teardown in any case, naming what
was called. An unconnected ``socket.socketpair`` (asyncio's event loop makes one) is allowed:
it reaches nothing outside the process. Native code that opens sockets itself (gloo, say) is
outside what a Python guard sees: such tests belong in ``tests/integration`` anyway.
"""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_SOCKET_CALLS = ("connect", "connect_ex", "bind", "listen")
_PROCESS_CALLS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system")


class HouseRuleViolation(BaseException):
    """A unit test opened a socket or started a process."""


def _tripwire(what: str, seen: list[str]) -> Callable[..., Any]:
    def trip(*args: Any, **kwargs: Any) -> Any:
        plain = [a for a in args if not isinstance(a, socket.socket)]
        shown = repr(plain[0])[:200] if plain else ""
        seen.append(f"{what}({shown})")
        raise HouseRuleViolation(
            f"tests/unit opens no sockets and starts no processes: this test called {what}({shown}); "
            "make it pure or move it to tests/integration"
        )

    return trip


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed


@pytest.fixture(autouse=True)
def no_sockets_no_processes(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[str]]:
    seen: list[str] = []
    for name in _SOCKET_CALLS:
        monkeypatch.setattr(socket.socket, name, _tripwire(f"socket.{name}", seen))
    for name in _PROCESS_CALLS:
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _tripwire(f"os.{name}", seen))
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _tripwire("a child process", seen))
    monkeypatch.setattr(subprocess, "_fork_exec", _tripwire("subprocess.Popen", seen))
    yield seen
    monkeypatch.undo()
    if seen and not request.node.stash.get(_CALL_FAILED, False):  # the test swallowed the error
        pytest.fail(
            "tests/unit opens no sockets and starts no processes, but this test called "
            + ", ".join(seen)
            + ": make it pure or move it to tests/integration",
            pytrace=False,
        )
