"""A graceful stop on SIGTERM: the request, and how the group agrees on it.

A kubelet evicting a pod, a drained or reclaimed node, a cancel and torchrun's agent (which
forwards the SIGTERM it got to its workers) all ask a worker to stop with SIGTERM, then SIGKILL
it once the grace period is over. A worker that got one stops at the next commit point (an
optimizer-step boundary), saves the step it reached and exits with :data:`EXIT_PREEMPTED`.

The ranks must stop at the same step, or the ones still training would wait in a collective for
the ones saving. The request rides on the all-reduce every step already runs
(:func:`worker.train.step.optimizer_step`): a rank asking adds :data:`STOP_UNIT` to element 0, the
non-finite flag (0, or NaN when a gradient is not finite; in peer mode plus the commit vote's
small count). Summed, ``element 0 // STOP_UNIT`` counts the ranks asking; the rest is the flag
as it would have been. A NaN window loses the request and it is made again the next window (a
skipped step saves nothing new either way). No number is added to the reduction.

The first SIGTERM is the request (SIGINT keeps Python's meaning: an interactive Ctrl-C stops at
once); later ones are noted and ignored: a stop is already
under way, a signal to a process group reaches a worker from its agent and from the sender
alike, and a save cut short would only lose its step. The sender's SIGKILL is the hard stop,
and the two-phase publish keeps the newest published checkpoint intact under it.

torchrun's agent itself sends SIGTERM to the workers it still has when one of them failed,
before it starts them all again. A peer-mode member re-forming after such a loss (or a newcomer
waiting to be called: :meth:`StopRequest.leaving_at_once`) would keep that request for a step
that never comes and be killed by the agent when its shutdown timeout is over. So a stop signal
while the group re-forms ends the process at once when a worker of its own node is gone
(:func:`local_peer_lost`); a loss on another node leaves it a request, carried by the first step
of the re-formed group, which saves.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from worker.errors import ElastrainError

STOP_UNIT = float(2**20)
"""What a rank asking to stop adds to the step's flag: above any count the commit vote adds
(at most one per member), and a sum over 2**20 ranks stays exact in float64."""

STRAGGLER = "straggler"
"""The request's name when the group chose this rank's node to leave for a spare
(``stragglers.action: replace``, :func:`leave_node`)."""

EXIT_PREEMPTED = 128 + int(signal.SIGTERM)
"""A worker that stopped on request exits as a process killed by SIGTERM reads (143): not 0,
which torchrun and a Kubernetes Job would take for a finished run."""


@dataclass(slots=True)
class StopRequest:
    """The first stop signal this process received, if any."""

    signal_name: str | None = None
    received_at: float | None = None
    repeats: int = 0
    at_once: bool = False
    """Whether the group re-forms (:meth:`leaving_at_once`)."""
    exit: Callable[[int], object] = field(default=os._exit, repr=False)
    torn_down: Callable[[], bool] = field(default=lambda: local_peer_lost(), repr=False)
    """Whether torchrun's agent is stopping this node's workers (a worker of its node is gone)."""

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @contextlib.contextmanager
    def leaving_at_once(self) -> Iterator[None]:
        """While the group re-forms, a stop signal (one that came already, or one that comes)
        ends the process at once with :data:`EXIT_PREEMPTED` when the agent is stopping this
        node's workers."""
        if self.requested and self.torn_down():
            self._leave(self.signal_name or "SIGTERM")
        self.at_once = True
        try:
            yield
        finally:
            self.at_once = False

    def _leave(self, name: str) -> None:
        sys.stderr.write(
            f"elastrain worker: {name} while the group re-forms and a worker of this node is gone: exiting\n"
        )
        sys.stderr.flush()
        self.exit(EXIT_PREEMPTED)

    def ask(self, reason: str) -> None:
        """A request from inside the group (``reason``, e.g. ``straggler``: the group chose this
        rank's node to leave for a spare), carried like a signal's; a request already made stays."""
        if self.signal_name is None:
            self.signal_name, self.received_at = reason, time.time()

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        """The signal handler: remember the first signal; note the others; leave at once while
        the group re-forms and the agent is stopping this node's workers."""
        name = signal.Signals(signum).name
        if self.at_once and self.torn_down():
            self._leave(name)
        if self.signal_name is None:
            self.signal_name, self.received_at = name, time.time()
            return
        self.repeats += 1
        sys.stderr.write(f"elastrain worker: {name} again: the graceful stop already under way goes on\n")


def local_peer_lost(proc: str = "/proc") -> bool:
    """Whether fewer workers than torchrun's ``LOCAL_WORLD_SIZE`` still run under this process's
    parent (its agent; a zombie counts as gone). False when that cannot be read (no ``/proc``, a
    kernel without the children list, no agent)."""
    expected = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if expected <= 1:
        return False
    parent = os.getppid()
    try:
        children = Path(f"{proc}/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return False
    running = 0
    for pid in children:
        try:
            state = Path(f"{proc}/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        running += state != "Z"
    return running < expected


REQUEST = StopRequest()
"""This process's request (one per process: signals are per process)."""


def leave_node(reason: str, *, kill: Callable[[int, int], None] = os.kill, agent: int | None = None) -> None:
    """This rank's node leaves the group: ask to stop at the next step boundary, like a signal
    (:meth:`StopRequest.ask`; in peer mode with ranks remaining that is a leave without a save),
    and send SIGTERM to this process's torchrun agent (its parent), so that the node ends instead
    of having its workers started again; the agent passes the signal on to its workers, whose
    request is made already. Nothing is sent where there is no agent (the parent is init)."""
    REQUEST.ask(reason)
    parent = os.getppid() if agent is None else agent
    if parent > 1:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill(parent, signal.SIGTERM)


def install() -> None:
    """Make SIGTERM a graceful stop request (main thread only)."""
    signal.signal(signal.SIGTERM, REQUEST.handle)


class Preempted(ElastrainError):
    """The group stopped on request at ``step`` (saved, when it has a checkpoint directory)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped on request at step {step}")
        self.step = step


def ballot(requested: bool) -> float:
    """This rank's addition to the step's flag. Pure."""
    return STOP_UNIT if requested else 0.0


def split(summed: float) -> tuple[int, float]:
    """(how many ranks asked to stop, the flag without the requests) from the reduced element
    0. A NaN stays NaN and carries no request. Pure."""
    if not math.isfinite(summed) or summed < STOP_UNIT:
        return 0, summed
    asking = math.floor(summed / STOP_UNIT)
    return asking, summed - asking * STOP_UNIT


def hand_off(*, asking: int, world_size: int, peer: bool) -> bool:
    """Whether the ranks asking to stop leave without a save and the others go on: in peer mode,
    when some ranks remain (they keep the state in memory and re-form without the leavers, who
    exit at this step boundary with nothing in flight). Otherwise the whole group saves the step
    and stops. Pure."""
    return peer and 0 < asking < world_size
