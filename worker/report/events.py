"""What the worker says: JSON lines on stdout for machines, a readable line on stderr for people.

Only rank 0 speaks unless told otherwise. One JSON object per line, always with ``event``.

A place that cannot take a line (a full volume under the run directory, or under the node's log
files that stdout and stderr are redirected to) is written no more: the first failure is said
once, on the other stream, and training goes on (the sinks, e.g. the service, still hear every
event). Nothing here raises for a write.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

Sink = Callable[[str, dict[str, Any]], None]


class Events:
    """``sinks`` see every event of this rank (e.g. the service client), printed or not."""

    def __init__(self, *, enabled: bool, job: str, rank: int) -> None:
        self.enabled = enabled
        self.job = job
        self.rank = rank
        self.sinks: list[Sink] = []
        self.log_path: Path | None = None  # rank 0 appends every event here too (the run dir)
        self.copies: list[Callable[[str, str], None]] = []  # (event, line) of every line written
        self.stopped: dict[str, str] = {}  # a place no longer written -> why

    def emit(self, event: str, **fields: Any) -> None:
        for sink in self.sinks:
            sink(event, fields)
        if self.enabled:
            self._write(event, fields)

    def record(self, event: str, **fields: Any) -> None:
        """Like :meth:`emit`, but said whatever this rank: what only this process knows (in peer
        mode, a recovery as its leader decided and timed it; the leader is not always rank 0)."""
        for sink in self.sinks:
            sink(event, fields)
        self._write(event, fields)

    def _write(self, event: str, fields: dict[str, Any]) -> None:
        record = {"event": event, "job": self.job, "time": round(time.time(), 3), **fields}
        line = json.dumps(record, sort_keys=False, default=str) + "\n"
        if "stdout" not in self.stopped:
            try:
                sys.stdout.write(line)
                sys.stdout.flush()
            except OSError as exc:
                self._stop("stdout", exc)
        path = self.log_path
        if path is not None and str(path) not in self.stopped:
            try:
                with path.open("a", encoding="utf-8") as out:
                    out.write(line)
            except OSError as exc:
                self._stop(str(path), exc)
        for copy in self.copies:
            copy(event, line)

    def say(self, text: str) -> None:
        if self.enabled and "stderr" not in self.stopped:
            try:
                sys.stderr.write(f"[elastrain {self.job}] {text}\n")
                sys.stderr.flush()
            except OSError as exc:
                self._stop("stderr", exc)

    def _stop(self, place: str, exc: OSError) -> None:
        """Write to ``place`` no more, and say so once: on stderr (on stdout when stderr is the
        place that failed), and to the sinks (``events_stopped``: the service records it)."""
        why = exc.strerror or str(exc)
        self.stopped[place] = why
        text = f"elastrain worker (rank {self.rank}): events are no longer written to {place}: {why}"
        other = sys.stdout if place == "stderr" else sys.stderr
        with contextlib.suppress(OSError, ValueError):  # full too: nothing is left to say it on
            other.write(text + "\n")
            other.flush()
        for sink in self.sinks:
            sink("events_stopped", {"place": place, "reason": why})


def progress_line(
    *, step: int, max_steps: int, samples: int, loss: float, rate: float, scale: float, skipped: int
) -> str:
    return (
        f"step {step}/{max_steps}  samples {samples}  loss {loss:.5f}  "
        f"{rate:,.0f} samples/s  loss-scale {scale:g}  skipped {skipped}"
    )


def resumed_line(
    *, step: int, checkpoint: str, samples: int, world_size: int, saved_at: int, note: str
) -> str:
    """What a person reads when a run resumes: from which checkpoint and step, at which world
    size (and the one that saved it, when another), and the batch plan there."""
    sizes = f"world size {world_size}" + (
        f" (saved at {saved_at})" if saved_at and saved_at != world_size else ""
    )
    return f"resumed from step {step} ({checkpoint}, {samples} samples seen) at {sizes}: {note}"


def straggler_line(fields: Mapping[str, Any]) -> str:
    """The job's event for a ``straggler`` the group named (:mod:`worker.train.stragglers`). Pure."""
    node = fields.get("node")
    where = f" on node {node}" if node is not None else ""
    return (
        f"rank {fields['rank']}{where} computed {fields['slowdown']}x the median of the other ranks "
        f"(above {fields.get('threshold')}x) in {fields.get('windows')} windows in a row, "
        f"steps {fields.get('first_step')}-{fields['step']}"
    )


def replace_line(leaves: bool, fields: Mapping[str, Any]) -> str:
    """The job's event for a named straggler under ``stragglers.action: replace``: its node
    leaves for a spare (``straggler_replaced``) or stays (``straggler_kept``), and why. Pure."""
    node = fields.get("node")
    what = f"rank {fields['rank']} on node {node}" if node is not None else f"rank {fields['rank']}"
    done = "leaves the group at the next step boundary" if leaves else "is not replaced"
    return f"{what} ({fields['slowdown']}x) {done} after step {fields['step']}: {fields['why']}"


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ")  # gloo's and c10d's "[file.cc:537] "


def lost_peer_line(
    *,
    rank: int,
    world_size: int,
    step: int | None,
    error: str,
    restarts: tuple[int, int] | None,
    checkpoints: bool,
    traceback_at: str | None,
) -> str:
    """One line for a rank whose group broke under it (a peer died or stalled: see
    :func:`worker.recovery.failure.classify`): who was lost, when, the transport's words, and what
    happens next. ``restarts``: torchrun's (restarts done, most allowed), None outside torchrun.
    Pure."""
    peer = f"rank {1 - rank}" if world_size == 2 else f"a peer of its group of {world_size}"
    kind, _, words = error.partition(": ")
    words = _SOURCE_PREFIX.sub("", words).split(". ")[0] or kind
    when = "before its first step" if step is None else f"after step {step}"
    resume = (
        "resumes from the newest published checkpoint" if checkpoints else "starts over (no checkpoint.dir)"
    )
    if restarts is None:
        then = "the run stops"
    elif restarts[0] < restarts[1]:
        then = f"torchrun restarts the group (restart {restarts[0] + 1} of {restarts[1]}), which {resume}"
    else:
        then = f"no torchrun restart is left (--max-restarts={restarts[1]}): the run stops"
    where = f"; traceback in {traceback_at}" if traceback_at else ""
    return f"elastrain worker (rank {rank}): lost {peer} {when} ({words}); {then}{where}"


def torchrun_restarts(env: Mapping[str, str]) -> tuple[int, int] | None:
    """torchrun's (restarts done, most allowed) from a worker's environment; None outside it."""
    try:
        return int(env["TORCHELASTIC_RESTART_COUNT"]), int(env["TORCHELASTIC_MAX_RESTARTS"])
    except (KeyError, ValueError):
        return None
