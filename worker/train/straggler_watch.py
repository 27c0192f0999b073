"""A rank's compute clock and the group's straggler watch (decisions: :mod:`worker.train.stragglers`).

What is measured, per step, on the host's clock: forward and backward, from the window's start to
the moment this rank's last gradient was accumulated, less the time it waited for its input
batches; and the optimizer's ``step()``. DDP overlaps the gradient all-reduce with the backward
and waits for the last bucket when the backward ends: a rank that computes faster than the others
waits there for them, and the step's own all-reduce (the non-finite flag) follows, where the rank
that left the gradient all-reduce first waits for the other. Both waits are left out: a hook after
every parameter's gradient accumulation marks the end of this rank's own backward, and the
optimizer's step hooks time its step. The gradient checks and clipping between the two (a few
operations beside the flag's all-reduce) are not counted. The first step of every group is not
counted (DDP builds its buckets then).

Not measured: FSDP (its reduce-scatters wait inside the backward, between the gradients) and
CUDA devices (the host's clock sees when work was queued, not when the device ran it); there the
watch sends nothing and names no one.

Once per window the ranks share their median step's compute seconds (a step that lost the CPU
to a neighbour now and then moves a median little; a rank that is slow on most steps moves it
all the way) on the all-reduce every step already
runs (:func:`worker.train.step.optimizer_step`'s ``votes``): ``2 W`` numbers on one step in
``window_steps``, no collective of its own.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from worker.jobspec.stragglers import StragglerSpec
from worker.metrics import WorkerMetrics
from worker.report.events import Events, replace_line, straggler_line
from worker.train import preemption, stragglers
from worker.train.stragglers import Streaks


def node_number(env: Mapping[str, str]) -> int:
    """This process's node: the service's node index, else torchrun's node rank, else 0."""
    for key in ("ELASTRAIN_NODE_INDEX", "GROUP_RANK"):
        raw = env.get(key, "")
        if raw.isdigit():
            return int(raw)
    return 0


class StragglerWatch:
    """One rank's side of the straggler watch. The trainer calls :meth:`backward_done` after
    the window's backward, :meth:`ballot` for the numbers to add to the step's all-reduce,
    :meth:`read` with their sums, and :meth:`measured` once the window is over."""

    def __init__(
        self,
        spec: StragglerSpec,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        events: Events,
        metrics: WorkerMetrics | None,
        node: int,
        active: bool,
    ) -> None:
        self.spec, self.events, self.metrics, self.node, self.active = spec, events, metrics, node, active
        self.last_grad = 0.0
        self.backward_at = 0.0
        self.optimizer_began, self.optimizer_s = 0.0, 0.0
        self.times: list[float] = []
        self.seat: tuple[int, int] | None = None
        self.streaks = Streaks()
        # stragglers.action replace (peer mode sets them: worker.peer.loop): the warm spares
        # waiting as this rank counts them (the group's leader: the others count 0), the
        # group's smallest world, and how this rank's node leaves
        self.spares: Callable[[], int] | None = None
        self.min_world = 1
        self.leave: Callable[[str], None] = preemption.leave_node
        if active:
            for p in model.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._tick)
            optimizer.register_step_pre_hook(self._optimizer_begins)
            optimizer.register_step_post_hook(self._optimizer_ends)

    def _tick(self, _param: Any) -> None:
        self.last_grad = time.perf_counter()

    def _optimizer_begins(self, *_: Any) -> None:
        self.optimizer_began = time.perf_counter()

    def _optimizer_ends(self, *_: Any) -> None:
        self.optimizer_s += time.perf_counter() - self.optimizer_began

    def backward_done(self) -> None:
        self.backward_at = time.perf_counter()

    def measured(self, *, started: float, data_wait: float, rank: int, world_size: int) -> None:
        """The window that began at ``started`` is over: add its compute time. A new seat (the
        first window, or a re-formed group) starts over."""
        optimizer_s, self.optimizer_s = self.optimizer_s, 0.0
        last_grad, self.last_grad = self.last_grad, 0.0
        if not self.active:
            return
        if self.seat != (rank, world_size):
            self.seat, self.streaks = (rank, world_size), Streaks()
            self.times = []
            return
        grads_done = last_grad if started < last_grad <= self.backward_at else self.backward_at
        self.times.append(max(grads_done - started - data_wait, 0.0) + optimizer_s)

    def ballot(self, step: int, *, rank: int, world_size: int) -> tuple[float, ...]:
        """The numbers this rank adds to the all-reduce of ``step``: none but on a window's last
        step (and none when inactive, or in a world of one)."""
        if not self.active or world_size < 2 or step % self.spec.window_steps:
            return ()
        seated = bool(self.times) and self.seat == (rank, world_size)
        per_step = statistics.median(self.times) if seated else 0.0
        spares = None
        if self.spec.action == "replace":
            spares = self.spares() if self.spares is not None else 0
        return stragglers.ballot(
            rank=rank, world_size=world_size, seconds_per_step=per_step, node=self.node, spares=spares
        )

    def read(self, summed: Sequence[float], step: int, *, rank: int, world_size: int) -> None:
        """The window's sums came back (every rank has the same): judge, say what is found."""
        if not summed:
            return
        self.times = []
        times, nodes, spares = stragglers.unpack(summed, world_size)
        ratios = stragglers.slowdowns(times)
        spec = self.spec
        self.streaks, found = stragglers.judge(
            self.streaks, ratios, step=step, window_steps=spec.window_steps, threshold=spec.slowdown,
            windows=spec.windows,
        )  # fmt: skip
        mine = ratios[rank] if rank < len(ratios) else None
        if self.metrics is not None and mine is not None:
            self.metrics.straggler(mine)
        rounded = [None if r is None else round(r, 4) for r in ratios]
        self.events.emit(
            "straggler_window", step=step, slowdown=rounded, compute_seconds=[round(t, 6) for t in times]
        )
        for named in found:
            fields = {
                "rank": named.rank, "node": nodes[named.rank], "slowdown": round(named.slowdown, 4),
                "first_step": named.first_step, "step": named.step, "windows": named.windows,
                "threshold": spec.slowdown,
            }  # fmt: skip
            self.events.emit("straggler", **fields)
            self.events.say(straggler_line(fields))
        if spec.action == "replace":
            self._replace(found, nodes, spares=spares)
            if not found and spares > 0 and self.spares is not None:  # a kept straggler, a spare now
                again = stragglers.still_slow(self.streaks, ratios, found, step=step, threshold=spec.slowdown)
                self._replace(again, nodes, spares=spares, only_leave=True)

    def _replace(
        self,
        found: Sequence[stragglers.Named],
        nodes: Sequence[int | None],
        *,
        spares: int,
        only_leave: bool = False,
    ) -> None:
        """``stragglers.action: replace``: the slowest named rank's node leaves for a spare, or
        stays and the event says why (:func:`worker.train.stragglers.replacement`); with
        ``only_leave`` (a rank kept before, still slow) nothing is said when it stays again."""
        named = stragglers.slowest(found)
        if named is None:
            return
        if self.spares is None:  # not in peer mode: nothing can take the node's place
            decision = stragglers.Replacement(False, None, (), "the job does not run in peer mode")
        else:
            decision = stragglers.replacement(named, nodes, spares=spares, min_world=self.min_world)
        if only_leave and not decision.leave:
            return
        fields = {
            "rank": named.rank, "node": decision.node, "slowdown": round(named.slowdown, 4),
            "step": named.step, "ranks": list(decision.ranks), "why": decision.why,
        }  # fmt: skip
        event = "straggler_replaced" if decision.leave else "straggler_kept"
        self.events.emit(event, **fields)
        self.events.say(replace_line(decision.leave, fields))
        if decision.leave and decision.node == self.node:
            self.leave(preemption.STRAGGLER)
