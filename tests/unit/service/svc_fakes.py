"""An in-memory scheduler, a settable clock and a torch-free phase-1 stager for the control
plane's tests."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

from service.launch.protocol import UNKNOWN, NodeLaunch, NodeStatus
from worker.checkpoint.commit import Report
from worker.checkpoint.layout import shard_file_name, staging_dir_name
from worker.checkpoint.manifest import TensorEntry
from worker.checkpoint.saveplan import TensorInfo, split_replicated
from worker.checkpoint.shardio import write_shard
from worker.jobspec.spec import JobSpec


def with_recovery(
    spec: JobSpec, *, mode: str = "peer", spares: int = 0, max_incidents: int | None = None
) -> JobSpec:
    """``spec`` with ``recovery.mode``, ``recovery.max_incidents`` and ``spares``,
    validated as a submitted spec is."""
    raw = spec.model_dump(mode="json", by_alias=True)
    raw["recovery"] = {**raw["recovery"], "mode": mode, "max_incidents": max_incidents}
    return JobSpec.model_validate_json(json.dumps({**raw, "spares": spares}))


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeScheduler:
    """Launches nothing; records launches and cancels; tests set each app's status. The whole
    :class:`service.launch.protocol.Scheduler` protocol."""

    def __init__(self) -> None:
        self.launches: list[NodeLaunch] = []
        self.calls: list[str] = []
        self.states: dict[str, NodeStatus] = {}
        self.cancelled: list[str] = []
        self.refuse: str | None = None
        self.closed = False

    def launch(self, node: NodeLaunch) -> str:
        if self.refuse:
            raise RuntimeError(self.refuse)
        handle = f"fake://{node.launch_id}"
        self.calls.append(node.launch_id)
        if handle in self.states:
            return handle  # idempotent per launch id, like the TorchX scheduler
        self.launches.append(node)
        self.states[handle] = NodeStatus("running")
        return handle

    def status(self, handle: str) -> NodeStatus:
        return self.states.get(handle, UNKNOWN)

    def cancel(self, handle: str) -> None:
        self.cancelled.append(handle)
        if self.states.get(handle, UNKNOWN).state == "running":
            self.states[handle] = NodeStatus("failed", -15)

    def log_dir(self, handle: str) -> Path | None:
        return None  # nothing runs, nothing logs

    def close(self) -> None:
        self.closed = True

    def finish(self, launch_id: str, *, exit_code: int = 0) -> None:
        state = "succeeded" if exit_code == 0 else "failed"
        self.states[f"fake://{launch_id}"] = NodeStatus(state, exit_code)  # type: ignore[arg-type]

    @property
    def launch_ids(self) -> list[str]:
        return [node.launch_id for node in self.launches]


BLOCK = 1 << 20


def stage_rank(job_dir: Path, *, job: str, step: int, generation: int, rank: int, world_size: int) -> Report:
    """Phase 1 of one rank, torch-free: its share of a replicated float32 tensor ``w`` of
    ``2 * world_size`` rows, written with the worker's shard writer; returns its report."""
    staging = job_dir / staging_dir_name(step, generation)
    staging.mkdir(parents=True, exist_ok=True)
    info = TensorInfo("w", "float32", (2 * world_size,))
    assignments = split_replicated([info], world_size)[rank]
    values = array("f", [float(step * 100 + i) for i in range(2 * world_size)]).tobytes()
    items = [(a, memoryview(values)[a.start * 4 : a.stop * 4]) for a in assignments]
    name = shard_file_name(rank)
    pieces, entry = write_shard(staging / name, items, block_size=BLOCK)
    return Report(
        step=step,
        generation=generation,
        rank=rank,
        world_size=world_size,
        ok=True,
        files={name: entry},
        pieces=tuple(pieces),
        tensors={"w": TensorEntry("float32", (2 * world_size,), "replicated")},
        meta_digest="meta",
        context={
            "job": job,
            "block_size": BLOCK,
            "parallelism": "ddp",
            "metrics": {"loss": 1.0 / (step + 1)},
        },
    )
