"""The worker's events on a full volume: a place that cannot take a line is written no more, the
failure is said once on the other stream, the sinks still hear every event, nothing raises.
``/dev/full`` (Linux) answers every write with ENOSPC, as a full volume does."""

from __future__ import annotations

import errno
import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from worker.report.events import Events

FULL = Path("/dev/full")


def events(heard: list[tuple[str, dict[str, Any]]]) -> Events:
    out = Events(enabled=True, job="j", rank=0)
    out.sinks.append(lambda name, fields: heard.append((name, fields)))
    return out


def test_a_full_run_directory_is_written_no_more_and_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    stdout, stderr = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    heard: list[tuple[str, dict[str, Any]]] = []
    ev = events(heard)
    ev.log_path = FULL
    for step in range(5):
        ev.emit("progress", step=step)
    assert stdout.getvalue().count('"event": "progress"') == 5, "stdout still takes every event"
    assert stderr.getvalue().count("no longer written to /dev/full") == 1
    assert "No space left on device" in stderr.getvalue()
    assert ev.stopped == {str(FULL): "No space left on device"}
    assert [n for n, _ in heard].count("progress") == 5
    assert [f for n, f in heard if n == "events_stopped"] == [
        {"place": str(FULL), "reason": "No space left on device"}
    ]


class FullStream(io.StringIO):
    """A stream on a full volume: every write fails with ENOSPC."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_stdout_and_stderr_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", FullStream())
    monkeypatch.setattr(sys, "stderr", FullStream())
    heard: list[tuple[str, dict[str, Any]]] = []
    ev = events(heard)
    for step in range(3):
        ev.emit("progress", step=step)
        ev.say(f"step {step}")
    ev.record("recovery", phase="started")
    assert ev.stopped == {"stdout": "No space left on device", "stderr": "No space left on device"}
    assert [n for n, _ in heard].count("events_stopped") == 2
    assert [n for n, _ in heard if n != "events_stopped"] == ["progress"] * 3 + ["recovery"]
