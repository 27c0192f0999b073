"""The probe :mod:`benchmarks.peer_steady` puts in a job's workers, through the model factory
contract (``"model": {"factory": "benchmarks.peer_probe:mlp"}``, the repository on the job's
``PYTHONPATH``): it returns the benchmark's MLP and, once per process, wraps ``Trainer.window``.

From step ``warm`` on, the windows go in blocks of ``block``, three blocks a cycle, one per arm
(``peer``, ``restart``, ``control``), their order rotating from cycle to cycle
(:func:`arm_at`). In a peer-mode job the ``restart`` and ``control`` blocks train without what
peer mode adds to the training thread's window -- the commit vote on the step's all-reduce, the
window's derived random streams, the glances at the agent -- and the ``peer`` blocks with it: an
A/B of peer mode's step path inside one job, the arms a second apart, so that this machine's
drift (runs of one mode differ by up to ~30% minutes apart) moves both alike; ``control`` against
``restart`` is the same arm twice (A/A). Every rank computes the same arm from the same step, so
the all-reduce's length agrees. In a ``restart`` block the lifeline thread's schedule is kept as
the glances keep it (``glanced_at`` refreshed, no look), so that its work is the same in every
block; that thread, like everything else outside the training thread, is counted by its CPU.

Each process writes ``peer-probe-<rank>-<pid>.json`` into the job's checkpoint directory at its
end: every window's arm, cycle, wall and thread-CPU seconds, and two snapshots of CPU ticks (at
step ``warm`` and at the end): its own threads by name and, on rank 0, every process on the
machine (pid, parent, name), for the driver to split the rest of the machine's CPU by role.
Only a benchmark puts this in a job.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.stats import block_arm

ARMS = ("peer", "restart", "control")
PARTS = ("commit", "rng", "glance")  # what peer mode adds to the training thread's window
_installed = False


def arm_at(step: int, *, block: int, warm: int) -> tuple[str, int] | None:
    """The arm and cycle of the window that trains ``step`` + 1 (:func:`benchmarks.stats.block_arm`)."""
    return block_arm(ARMS, step, block=block, warm=warm)


def mlp(
    meta: dict[str, Any],
    *,
    hidden: int,
    depth: int,
    block: int = 10,
    warm: int = 40,
    parts: bool = False,
    keep: str = ",".join(PARTS),
    dummy: bool = False,
) -> Any:
    from worker.start.models import MLP

    install(block=block, warm=warm, parts=parts, keep=frozenset(keep.split(",")) & set(PARTS), dummy=dummy)
    return MLP(int(meta["input_dim"]), int(meta["output_dim"]), hidden=hidden, depth=depth)


def stat_ticks(path: str) -> tuple[str, int, int] | None:
    """(name, parent pid, utime + stime) from a /proc ``stat`` file."""
    try:
        with open(path, "rb") as f:
            line = f.read().decode(errors="replace")
    except OSError:
        return None
    name = line[line.index("(") + 1 : line.rindex(")")]
    fields = line[line.rindex(")") + 2 :].split()
    return name, int(fields[1]), int(fields[11]) + int(fields[12])


def threads() -> dict[str, dict[str, Any]]:
    """This process's threads: native id -> name (Python's, else the kernel's) and ticks."""
    named = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, dict[str, Any]] = {}
    for tid in os.listdir("/proc/self/task"):
        got = stat_ticks(f"/proc/self/task/{tid}/stat")
        if got is None:
            continue
        name = "main" if int(tid) == main else named.get(int(tid), f"native:{got[0]}")
        out[tid] = {"name": name, "ticks": got[2]}
    return out


def processes() -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (got := stat_ticks(f"/proc/{pid}/stat")) is not None:
            out[pid] = {"name": got[0], "ppid": got[1], "ticks": got[2]}
    return out


def snapshot(everything: bool) -> dict[str, Any]:
    return {
        "wall": time.monotonic(),
        "threads": threads(),
        "processes": processes() if everything else {},
    }


class _Timed:
    """``commit`` with the training thread's CPU in its two calls added up (``parts``)."""

    def __init__(self, commit: Any, spent: dict[str, float]) -> None:
        self.commit, self.spent = commit, spent

    def ballot(self) -> Any:
        started = time.thread_time()
        try:
            return self.commit.ballot()
        finally:
            self.spent["commit.ballot"] += time.thread_time() - started

    def decide(self, found: bool, summed: Any) -> bool:
        started = time.thread_time()
        try:
            return bool(self.commit.decide(found, summed))
        finally:
            self.spent["commit.decide"] += time.thread_time() - started


def timed(fn: Any, name: str, spent: dict[str, float]) -> Any:
    def call(*args: Any) -> Any:
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            spent[name] += time.thread_time() - started

    return call


class _Dummy:
    """A commit vote of the same length that decides nothing (``dummy``): the all-reduce's extra
    numbers and their tensor without the vote's Python."""

    def __init__(self, length: int) -> None:
        self.values = [0.0] * length

    def ballot(self) -> list[float]:
        return self.values

    def decide(self, found: bool, summed: Any) -> bool:
        return found


def install(
    *,
    block: int,
    warm: int,
    parts: bool = False,
    keep: frozenset[str] = frozenset(PARTS),
    dummy: bool = False,
) -> None:
    """``parts``: in the peer blocks, add up the training thread's CPU in each part peer mode adds
    (a diagnosis: the timing itself costs ~1 us a call). ``keep``: the parts the peer blocks keep
    (the others go in every block), to put a price on each."""
    global _installed
    if _installed:
        return
    _installed = True
    from worker.start import lifeline
    from worker.train.trainer import Trainer

    window, finish = Trainer.window, Trainer._finish
    glance, glancing = lifeline.glance, lifeline.glancing
    windows: list[tuple[str, int, float, float]] = []
    marks: list[dict[str, Any]] = []
    spent: dict[str, float] = dict.fromkeys(("commit.ballot", "commit.decide", "window_rng", "glance"), 0.0)

    def kept() -> None:  # the lifeline thread's schedule as glances keep it, without the look
        sight = lifeline._sight
        if sight is not None and lifeline._last_words:
            sight.glanced_at = time.monotonic()

    def probed(self: Trainer, feed: Any) -> None:
        got = arm_at(self.progress.step, block=block, warm=warm)
        if got is None:
            window(self, feed)
            return
        if not marks:
            marks.append(snapshot(self.info.rank == 0))
        arm, cycle = got
        held = self.commit, self.window_rng
        off = set(PARTS) if arm != "peer" else set(PARTS) - keep
        if "commit" in off:
            self.commit = None
        if "rng" in off:
            self.window_rng = None
        if "glance" in off:
            lifeline.glance, lifeline.glancing = kept, lambda items: items
        if arm == "peer" and dummy and self.commit is not None:
            self.commit = _Dummy(len(self.commit.ballot()))
        if arm == "peer" and parts:
            if self.commit is not None:
                self.commit = _Timed(self.commit, spent)
            if self.window_rng is not None:
                self.window_rng = timed(self.window_rng, "window_rng", spent)
            if "glance" not in off:
                lifeline.glance = timed(glance, "glance", spent)
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            window(self, feed)
        finally:
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            self.commit, self.window_rng = held
            lifeline.glance, lifeline.glancing = glance, glancing
        windows.append((arm, cycle, wall, cpu))

    def finished(self: Trainer) -> dict[str, Any]:
        if marks and self.spec.checkpoint.dir is not None:
            marks.append(snapshot(self.info.rank == 0))
            out = Path(self.spec.checkpoint.dir) / f"peer-probe-{self.info.rank}-{os.getpid()}.json"
            out.write_text(json.dumps({
                "rank": self.info.rank, "pid": os.getpid(), "ppid": os.getppid(), "block": block,
                "windows": windows, "marks": marks,
                "parts": spent if parts else None,
            }))  # fmt: skip
        return finish(self)

    Trainer.window = probed  # type: ignore[method-assign]
    Trainer._finish = finished  # type: ignore[method-assign]
