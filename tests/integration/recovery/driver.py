"""A training process driven by worker.recovery alone (no Trainer): what the trainer's integration
will do, in miniature. ``python -m tests.integration.recovery.driver`` with ``DRIVER_ARGS`` (JSON).

A small MLP with dropout under DDP (small buckets: several of them, so the bucket layout matters
at W=3), AdamW, windows of ``accum`` micro-steps planned by worker.datapath.sampler from a global cursor,
random streams derived per window, the commit vote, and on a group failure: void the window,
tear down outside the except block, recover, carry on. Faults are injected by the process
itself: ``kill_at`` (SIGKILL at a random moment of that window), ``stop_at`` (SIGSTOP before
that window), or ``ELASTRAIN_FAILPOINTS`` (peer_send_chunk / peer_receive_chunk).

Every event is one JSON line in ``<out>/events-<pid>.jsonl``; the sample trace (committed
windows only) in ``<out>/trace-<pid>.jsonl``.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from worker.datapath.sampler import SamplerState, indices, plan_window
from worker.recovery.etcdkv import connect
from worker.recovery.failure import Failure, classify
from worker.recovery.group import GroupInfo, teardown
from worker.recovery.plan import Policy
from worker.recovery.recover import GroupMember, Outcome, RecoveryConfig
from worker.recovery.rewrap import NO_LAYOUT, bucket_layout, rewrap
from worker.recovery.rng import derive_window_rng
from worker.start.dist import DistInfo
from worker.start.parts import params_digest

DIM, HIDDEN, OUT = 32, 128, 8
BUCKET_MB = 0.02


def warm_up(
    model: nn.Module, step: Callable[[DistributedDataParallel], None], *, bucket_cap_mb: float
) -> None:
    """A spare's start-up costs paid ahead: one DDP wrap (its first in a process imports
    ``torch._dynamo``, ~1.8 s here) and one ``step(ddp)`` on a private world-of-one gloo group,
    torn down after. (The worker's spare builds its trainer in such a world: worker.peer.run.)"""
    teardown()
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
    )
    try:
        ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
        step(ddp)
        del ddp
    finally:
        teardown()


class Log:
    def __init__(self, out: Path) -> None:
        self.events = out / f"events-{os.getpid()}.jsonl"
        self.trace = out / f"trace-{os.getpid()}.jsonl"

    def emit(self, event: str, fields: dict[str, Any] | None = None) -> None:
        record = {"event": event, "t": time.time(), "pid": os.getpid(), **(fields or {})}
        with self.events.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def window(self, **record: Any) -> None:
        with self.trace.open("a") as f:
            f.write(json.dumps(record) + "\n")


class State:
    """The driver's RecoverableState."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(
            nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Dropout(0.2), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
            nn.Dropout(0.2), nn.Linear(HIDDEN, OUT),
        )  # fmt: skip
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.ddp: nn.Module | None = None
        self.ver, self.step = 0, 0
        self.sampler = SamplerState()

    def version(self) -> int:
        return self.ver

    def progress(self) -> dict[str, Any]:
        return {"version": self.ver, "step": self.step, "sampler": self.sampler.to_json()}

    def load_progress(self, blob: dict[str, Any]) -> None:
        self.ver, self.step = int(blob["version"]), int(blob["step"])
        self.sampler = SamplerState.from_json(blob["sampler"])

    def void_window(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.ddp = None

    def layout(self) -> bytes:
        return NO_LAYOUT  # the driver wraps afresh at every re-formation (the trainer may carry over)

    def rewrap(self, info: GroupInfo, *, keep: bool = False) -> None:
        base = DistInfo(info.rank, info.world_size, 0, "gloo", "cpu", 0, True)
        self.ddp = rewrap(self.model, info.dist_info(base), bucket_cap_mb=BUCKET_MB,
                          forward=lambda m: m(torch.zeros(1, DIM)).sum())  # fmt: skip


def dataset(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(size, DIM, generator=g), torch.randn(size, OUT, generator=g)


def suicide_during_window(log: Log, seed: int) -> None:
    delay = random.Random(seed).random() * 0.004

    def die() -> None:
        time.sleep(delay)
        log.emit("killed")
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=die, daemon=True).start()


def await_standby(args: dict[str, Any], state: State, member: GroupMember, log: Log) -> None:
    """``spares_by`` / ``joiners_by: [window, count]``: the leader holds that window until
    ``count`` spares (joiners) stand by, connected to it (the others wait in its first
    collective), so a test that needs its spares promoted in a set order, or a join at a set
    moment, does not race their connecting under load."""
    for role in ("spare", "joiner"):
        window, count = args.get(f"{role}s_by", (None, 0))
        if state.ver != window or not member.is_leader:
            continue
        deadline = time.time() + 60.0
        while member.hub.waiting(role) < count:
            if time.time() > deadline:
                log.emit("fatal", {"error": f"fewer than {count} {role}s connected within 60 s"})
                sys.exit(1)
            time.sleep(0.02)
        log.emit(f"{role}s_connected", {"count": count, "version": state.ver})


def train_window(args: dict[str, Any], state: State, member: GroupMember, data: Any, log: Log) -> bool:
    """One window; True when the vote asked for a planned re-formation. Raises on group failure."""
    info = member.info
    x_all, y_all = data
    window = plan_window(state.sampler, dataset_size=len(x_all), world_size=info.world_size,
                         micro_batch=args["micro_batch"], accum_steps=args["accum"])  # fmt: skip
    derive_window_rng(args["seed"], state.ver, info.rank)
    await_standby(args, state, member, log)
    if args.get("kill_at") == state.ver:
        suicide_during_window(log, args["seed"] + state.ver)
    if args.get("stop_at") == state.ver:
        log.emit("stopping")
        os.kill(os.getpid(), signal.SIGSTOP)
        log.emit("woke")
    ddp = state.ddp
    assert ddp is not None
    loaded: list[int] = []
    last = len(window.micro_steps) - 1
    for j, micro in enumerate(window.micro_steps):
        idx = torch.from_numpy(
            indices(args["seed"], window.epoch, len(x_all), micro.bounds[info.rank]).copy()
        )
        loaded += [int(i) for i in idx]
        sync = contextlib.nullcontext() if j == last else ddp.no_sync()  # type: ignore[operator]
        with sync:
            out = ddp(x_all[idx])
            loss = ((out - y_all[idx]) ** 2).sum() * (info.world_size / window.samples)
            loss.backward()
    grads = [p.grad for p in state.model.parameters() if p.grad is not None]
    nonfinite = not all(bool(torch.isfinite(g).all()) for g in grads)
    verdict = member.vote(nonfinite=nonfinite, version=state.ver)
    if not verdict.nonfinite:  # apply: nothing between the vote and here is a collective
        state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    log.window(generation=info.generation, version=state.ver, epoch=window.epoch, rank=info.rank,
               world_size=info.world_size, indices=loaded)  # fmt: skip
    state.sampler = window.after
    state.ver += 1
    state.step += 0 if verdict.nonfinite else 1
    time.sleep(args.get("step_sleep", 0.0))  # pacing, for a test that acts while the group trains
    return verdict.reform


def settle_outcome(outcome: Outcome, state: State, member: GroupMember, log: Log) -> None:
    log.emit("outcome", {"kind": outcome.kind, "reason": outcome.reason, "source_rank": outcome.source_rank,
                         "bytes": outcome.bytes_from_peers, "voided": outcome.voided_windows,
                         "version": outcome.version, "phases": outcome.phases, "attempts": outcome.attempts,
                         "lost": list(outcome.lost), "promoted": list(outcome.promoted),
                         "generation": outcome.info.generation if outcome.info else None,
                         "rank": outcome.info.rank if outcome.info else None,
                         "world_size": outcome.info.world_size if outcome.info else None})  # fmt: skip
    if outcome.kind == "storage":  # no checkpoint in this driver: a fresh job starts from its seed
        if state.ver != 0 or outcome.reason != "no member holds a valid state":
            log.emit("needs_storage", {"reason": outcome.reason})  # the trainer restores here
            member.close()
            sys.exit(5)
        state.rewrap(member.info)
        member.mark_valid()
        return
    if outcome.kind != "peer":
        member.close()
        sys.exit({"leave": 0, "fenced": 3}.get(outcome.kind, 4))


def done(args: dict[str, Any], state: State) -> bool:
    if "epochs" in args:
        return state.sampler.epoch >= args["epochs"]
    return state.ver >= args["windows"]


def run(args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    log = Log(Path(args["out"]))
    state = State(args["seed"])
    data = dataset(args["seed"], args["dataset"])
    policy = Policy(min_world=args["min_world"], max_world=args["max_world"],
                    join_window_s=args.get("join_window_s", 1.0),
                    replacement_timeout_s=args.get("replacement_timeout_s", 60.0))  # fmt: skip
    cfg = RecoveryConfig(job_id=args["job"], secret=args["secret"].encode(), spec_hash="driver-spec",
                         policy=policy, desired_world=args["world"],
                         chunk_bytes=args.get("chunk_bytes", 1 << 16),
                         collective_timeout_s=args.get("collective_timeout_s", 30.0))  # fmt: skip
    member = GroupMember(cfg, kv=connect(args["etcd"]), role=args["role"], node_index=args["node"],
                         launch_id=args.get("launch", ""),
                         on_event=log.emit)  # fmt: skip
    member.start()
    log.emit("started", {"role": args["role"], "member": member.member_id})
    if args["role"] == "spare":
        warm_up(state.model, lambda ddp: ddp(torch.zeros(2, DIM)).sum().backward(), bucket_cap_mb=BUCKET_MB)
        state.optimizer.step()  # creates the optimizer's state, as a spare's warm-up step would
        state.optimizer.zero_grad(set_to_none=True)
        log.emit("spare_standby", {"member_id": member.member_id, "control": member.me.control})
        outcome = member.join(state)
    else:
        outcome = member.join(state)
    settle_outcome(outcome, state, member, log)
    first = True
    while not done(args, state):
        failure: Failure | None = None
        try:
            planned = train_window(args, state, member, data, log)
        except Exception as exc:
            failure = classify(exc)
        if failure is None:
            if first:
                first = False
                member.publish()  # as worker.peer.loop does after a generation's first step
                log.emit("first_step", {"version": state.ver, "generation": member.info.generation})
            if not planned:
                continue
            failure = Failure.planned()
        if not failure.recoverable:
            log.emit("fatal", {"error": failure.message})
            sys.exit(1)
        state.void_window()
        teardown()
        settle_outcome(member.recover(state, failure), state, member, log)
        first = True
    finish(state, member, log)


def finish(state: State, member: GroupMember, log: Log) -> None:
    info = member.info
    layout = bucket_layout(state.ddp) if state.ddp is not None else None  # type: ignore[arg-type]
    log.emit("finished", {"digest": params_digest(state.model), "version": state.ver, "rank": info.rank,
                          "world_size": info.world_size, "generation": info.generation,
                          "layout": layout})  # fmt: skip
    dist.barrier()
    member.release_standby()
    state.ddp = None
    time.sleep(0.05)
    teardown()
    member.close()


if __name__ == "__main__":
    run(json.loads(os.environ["DRIVER_ARGS"]))
