"""Where this process stands in the worker group, and the process group itself.

``detect`` is pure (environment in, :class:`DistInfo` out). Outside torchrun the worker is a
world of one; it still builds a gloo group (on an in-memory store) so that one code path
serves both cases.
"""

from __future__ import annotations

import datetime
import gc
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker.errors import SpecError


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str
    restart_count: int
    under_torchrun: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SpecError(f"environment variable {key}={raw!r} is not an integer") from None


def detect(env: Mapping[str, str], *, backend: str, cuda_available: bool) -> DistInfo:
    """Rank, world size and backend: gloo on CPU, NCCL on GPU when ``backend`` is auto."""
    under = "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)
    rank = _int(env, "RANK", 0)
    world = _int(env, "WORLD_SIZE", 1)
    local = _int(env, "LOCAL_RANK", 0)
    chosen = backend
    if backend == "auto":
        chosen = "nccl" if cuda_available else "gloo"
    if chosen == "nccl" and not cuda_available:
        raise SpecError("field 'ddp.backend': nccl needs a GPU and none is visible; use auto or gloo")
    device = f"cuda:{local}" if chosen == "nccl" else "cpu"
    return DistInfo(
        rank=rank,
        world_size=world,
        local_rank=local,
        backend=chosen,
        device=device,
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        under_torchrun=under,
    )


def init_group(info: DistInfo, *, timeout_s: float = 300.0) -> None:
    """Create the default process group (idempotent)."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(info.device))
    if info.under_torchrun:
        dist.init_process_group(backend=info.backend, timeout=timeout)
    else:
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def agree_generation() -> int:
    """A number all ranks of this group share and no earlier group of the job had: rank 0's
    clock in milliseconds, broadcast. Not TORCHELASTIC_RESTART_COUNT: an agent that joins later,
    or restarts for a membership change, counts differently from the others (pytorch#135712),
    and ranks that disagree on the generation never complete a save or a restore."""
    value = torch.tensor([time.time_ns() // 1_000_000], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(value, src=0)
    return int(value.item())


def shutdown() -> None:
    """Tear the group down without the exit-time deadlock of torch 2.13's gloo backend.

    A finished gloo work is released on gloo's own thread, which needs the GIL to drop its
    tensors; if the group is destroyed first (under the GIL, from a Python finaliser) the join
    never returns. So: agree that all collectives are done, let gloo's threads run, then destroy.
    Callers drop their DDP wrappers before calling this.
    """
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        gc.collect()
        time.sleep(0.05)  # releases the GIL for gloo's threads
        dist.destroy_process_group()
