"""Data-parallel replicas compare their state: the digests and the collective.

Each check hashes a part of the parameters and optimizer state (all of it before a save: see
:mod:`worker.train.replicas`), each tensor on its own: on CPU xxh3-64 over its bytes in place (the
checkpoint blocks' hash family, no copy), on an accelerator a fold on the device (wrapping int64
sums of its words and of their squares: any one flipped bit changes the first), read to the host
once for the whole part. The tensors' digests make one 128-bit digest, and the ranks gather it (16 bytes
each, one ``all_gather``, in the background for a periodic check). Only when they differ do the
ranks gather their per-tensor digests, to name the tensors. Bit-exact: DDP replicas must be
identical, so any difference is a fault.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
import xxhash
from torch import nn

from worker.errors import ReplicaMismatchError
from worker.train import replicas

if TYPE_CHECKING:
    from worker.jobspec.spec import JobSpec
    from worker.metrics import WorkerMetrics
    from worker.report.events import Events
    from worker.start.dist import DistInfo

_CHUNK = 1 << 24  # elements folded at a time on a device: bounds the int64 temporaries
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_MASK = (1 << 64) - 1


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """The replicated state by name: parameters (a tied one once), then each parameter's
    optimizer state (``optimizer.<param>.<key>``), in a stable order. Buffers are not compared:
    each rank's batch-norm statistics follow its own batches."""
    named = sorted(model.named_parameters(remove_duplicate=True), key=lambda item: item[0])
    out = [(name, p.detach()) for name, p in named]
    name_of = {id(p): name for name, p in named}
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    out.append((f"optimizer.{name_of.get(id(p), '?')}.{key}", value.detach()))
    return out


def tensor_digests(tensors: list[torch.Tensor]) -> list[int]:
    """One 64-bit digest per tensor (as unsigned ints); equal bytes, equal digests."""
    out: list[int | None] = [None] * len(tensors)
    folds: list[tuple[int, torch.Tensor]] = []
    for i, t in enumerate(tensors):
        if t.device.type == "cpu":
            data = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            out[i] = xxhash.xxh3_64_intdigest(data.data)
        else:
            folds.append((i, _fold(t)))
    if folds:
        values = torch.stack([f for _, f in folds]).cpu().tolist()
        for (i, _), (a, b) in zip(folds, values, strict=True):
            out[i] = xxhash.xxh3_64_intdigest(((a & _MASK) << 64 | (b & _MASK)).to_bytes(16, "little"))
    return [int(d) for d in out if d is not None]


def _fold(t: torch.Tensor) -> torch.Tensor:
    """Two wrapping int64 sums over ``t``'s words, on its device (no read)."""
    flat = t.contiguous().reshape(-1)
    words = flat.view(_WORDS.get(flat.element_size(), torch.uint8))
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), _CHUNK):
        w = words[lo : lo + _CHUNK].to(torch.int64)
        total[0] += w.sum()
        total[1] += (w * w).sum()
    return total


def combine(digests: list[int]) -> tuple[int, int]:
    """The part's 128-bit digest as two signed int64 (what the collective carries)."""
    h = xxhash.xxh3_128_intdigest(b"".join(d.to_bytes(8, "little") for d in digests))
    return _signed(h >> 64), _signed(h & _MASK)


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


class Exchange(Protocol):
    """Every rank's ``values`` (the same length on every rank), started now: ``result()`` gives
    them by rank."""

    def __call__(self, values: list[int]) -> Gathered: ...


class Gathered(Protocol):
    def result(self) -> list[list[int]]: ...


class _Gather:
    """An ``all_gather`` of a few int64 per rank, started now (in the background) and read later."""

    def __init__(self, values: list[int], device: torch.device, world_size: int) -> None:
        self.mine = torch.tensor(values, dtype=torch.int64, device=device)
        self.got = [torch.empty_like(self.mine) for _ in range(world_size)]
        self.work = dist.all_gather(self.got, self.mine, async_op=True)

    def result(self) -> list[list[int]]:
        if self.work is not None:
            self.work.wait()
        return [t.cpu().tolist() for t in self.got]


@dataclass(slots=True)
class _Started:
    """A comparison whose digests are exchanged in the background."""

    step: int
    full: bool
    names: list[str]
    digests: list[int]
    gather: Gathered
    seconds: float


class ReplicaCheck:
    """Compares this rank's state with the other replicas' (a collective: every rank calls
    :meth:`check` at the same steps with the same ``full``)."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, every_steps: int,
        device: torch.device, world_size: int, events: Events, metrics: WorkerMetrics | None,
        exchange: Exchange | None = None, defer: bool = True,
    ) -> None:  # fmt: skip
        """``exchange``: how the ranks' digests travel (default: an ``all_gather`` on the
        default process group). ``defer``: a periodic check is judged at the next one (its
        gather in the background); else at once (peer mode: no collective is left in flight
        on a group that a recovery tears down)."""
        self.model, self.optimizer = model, optimizer
        self.every_steps, self.world_size = every_steps, world_size
        self.events, self.metrics = events, metrics
        self.exchange: Exchange = exchange or (lambda values: _Gather(values, device, world_size))
        self.pending: _Started | None = None
        self.defer = defer
        self._split: tuple[int, list[list[int]]] = (-1, [])  # (tensors, their parts)

    def due(self, step: int) -> bool:
        return replicas.due(step, self.every_steps)

    def check(self, step: int, *, full: bool) -> None:
        """Compare the state after ``step``: all of it with ``full`` (before a save: judged at
        once), else this step's part, whose digests travel in the background while training goes
        on and are judged at the next check (so the training thread never waits for them). A
        comparison still in flight is judged first. On a difference say which ranks and tensors
        (event ``replica_mismatch``, the metric) and raise :class:`ReplicaMismatchError`: the
        group stops before it saves anything, and resumes from the newest published checkpoint,
        which the replicas agreed on before it was saved (restart mode: torchrun's restart; peer
        mode: the group re-forms and restores it in process), and trains the steps since
        again. Without ``defer`` this check is judged at once too."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._judge(pending)
        started = self._start(step, full=full)
        if full or not self.defer:
            self._judge(started)
        else:
            self.pending = started

    def _start(self, step: int, *, full: bool) -> _Started:
        began = time.perf_counter()
        covered = self._covered(step, full=full)
        digests = tensor_digests([t for _, t in covered])
        gather = self.exchange(list(combine(digests)))
        return _Started(
            step=step, full=full, names=[n for n, _ in covered], digests=digests, gather=gather,
            seconds=time.perf_counter() - began,
        )  # fmt: skip

    def _judge(self, started: _Started) -> None:
        began = time.perf_counter()
        verdict = replicas.compare([tuple(g) for g in started.gather.result()])
        if self.metrics is not None:
            self.metrics.integrity(started.seconds + time.perf_counter() - began, mismatch=not verdict.agree)
        if verdict.agree:
            return
        per_rank = self.exchange([_signed(d) for d in started.digests]).result()
        tensors, ranks = replicas.differing(started.names, per_rank), list(verdict.ranks)
        line = replicas.describe(started.step, ranks, tensors, self.world_size)
        self.events.emit(
            "replica_mismatch", step=started.step, ranks=ranks, tensors=tensors[:64],
            tensors_differing=len(tensors), full=started.full, world_size=self.world_size, message=line,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.flush()
        raise ReplicaMismatchError(
            f"{line}; nothing was saved: the newest published checkpoint is kept", tuple(ranks)
        )

    def _covered(self, step: int, *, full: bool) -> list[tuple[str, torch.Tensor]]:
        state = state_tensors(self.model, self.optimizer)
        if full:
            return state
        if len(state) != self._split[0]:  # the optimizer's state appears at its first step
            self._split = (len(state), replicas.split([t.numel() * t.element_size() for _, t in state]))
        parts = self._split[1]
        return [state[i] for i in parts[replicas.part_at(step, self.every_steps, len(parts))]]


FSDP_NOTE = (
    "integrity: FSDP holds no replicas (each rank owns a shard of the state), so the ranks do not "
    "compare their state; each checkpoint shard's digest is verified when it is read"
)


def replica_check(
    spec: JobSpec, model: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo, *,
    events: Events, metrics: WorkerMetrics | None, notes: list[str], defer: bool = True,
) -> ReplicaCheck | None:  # fmt: skip
    """The job's check: None when ``integrity.enabled`` is off, with one rank (nothing to compare
    with), or under FSDP (which ``notes`` and rank 0's stderr say). ``defer``: see
    :class:`ReplicaCheck`."""
    if not spec.integrity.enabled or info.world_size < 2:
        return None
    if spec.parallelism != "ddp":
        notes.append(FSDP_NOTE)
        events.say(FSDP_NOTE)
        return None
    return ReplicaCheck(
        model, optimizer, every_steps=spec.integrity.every_steps, device=torch.device(info.device),
        world_size=info.world_size, events=events, metrics=metrics, defer=defer,
    )  # fmt: skip
