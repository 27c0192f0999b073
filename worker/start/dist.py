"""Where this process stands in the worker group, and the process group itself.

``detect`` is pure (environment in, :class:`DistInfo` out). Outside torchrun the worker is a
world of one; it still builds a gloo group (on an in-memory store) so that one code path
serves both cases.

Under torchrun the worker forms its group on a store prefix of its own per round
-------------------------------------------------------------------------------
torchrun tells the workers where a TCPStore is (``MASTER_ADDR``/``MASTER_PORT``) and whether its
agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``). With the default *static* rendezvous (plain
``torchrun --nproc-per-node N``: the agent's store on port 29500) and with the c10d backend
(``--standalone``, ``--rdzv-backend c10d``) unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is set
in the agent, the agent hosts that store and keeps it across restarts, and
``init_process_group`` puts every group's keys under the same fixed ``default_pg/`` prefix. A
restarted group then reads the dead group's keys (gloo's peer addresses, NCCL's unique id) and
fails or hangs in ``init_process_group``: torchrun's first-restart trap, pytorch#135712. For the
static backend the variable does not even exist as a remedy.

What identifies a round? Nothing torchrun hands the workers does, consistently on every rank:
``TORCHELASTIC_RESTART_COUNT`` is each agent's own count (an agent that joins later, or restarts
its workers for a membership change, counts differently, and a membership change restarts the
workers without counting at all), and ``MASTER_PORT`` of a shared store is the same in every
round. So the ranks make the identity themselves: :func:`worker.start.rounds.agree_round` gives every
rank of the new group one fresh random token through the store, by a protocol no leftover key
can fool (rank 0 answers each rank's fresh nonce), and the group is created with
``init_process_group(store=PrefixStore("elastrain/round/<run id>/<token>", store))``. Everything
that later uses the default store (the in-job checkpoint coordinator's session counter, save
reports and outcomes, the restore agreement) lives under that prefix too, because
``_get_default_store()`` returns the store the group was created with. The store itself comes
from ``torch.distributed.rendezvous("env://")``, so torchrun's own rules (agent-hosted or hosted
by worker rank 0) hold unchanged; where the store is fresh per attempt anyway (the service's
``etcd-v3`` handler forces ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) the agreement costs a few
milliseconds and changes nothing. The alternative, a store of the worker's own, still needs its
address passed through the shared store, so it needs the same agreement and adds a port.

No start-up wait is unbounded: :func:`start_group` runs the store connection, the round
agreement, the group's creation and the generation broadcast under one
:class:`worker.start.rounds.Watchdog` of ``ELASTRAIN_COLLECTIVE_TIMEOUT_S`` seconds; each wait uses
what is left as its own timeout and the watchdog catches any that does not honour it. Either
way the process writes one line (what it waited for, how long) and exits 1, so torchrun's
restart applies.
"""

from __future__ import annotations

import datetime
import gc
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from worker.errors import SpecError
from worker.start.rounds import Watchdog, agree_round, exit_now

ROUND_PREFIX = "elastrain/round"


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: str
    restart_count: int
    under_torchrun: bool
    store_addr: str = ""  # MASTER_ADDR:MASTER_PORT under torchrun ("" when either is missing)
    run_id: str = ""  # TORCHELASTIC_RUN_ID

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


def detect(env: Mapping[str, str], *, backend: str, gpus: int) -> DistInfo:
    """Rank, world size and backend from the environment and the ``gpus`` this process sees.

    ``auto``: NCCL on GPU ``LOCAL_RANK`` when every process of the node has a GPU of its own
    (``LOCAL_WORLD_SIZE <= gpus``), else gloo on CPU (:func:`backend_note` says why); every
    process of a node decides alike. ``nccl`` without a GPU for this process is refused: NCCL
    refuses two ranks on one GPU, and a rank past the last GPU has none."""
    under = "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env)
    rank = _int(env, "RANK", 0)
    world = _int(env, "WORLD_SIZE", 1)
    local = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
    chosen = backend
    if backend == "auto":
        chosen = "nccl" if 0 < local_world <= gpus else "gloo"
    if chosen == "nccl" and gpus == 0:
        raise SpecError("field 'ddp.backend': nccl needs a GPU and none is visible; use auto or gloo")
    if chosen == "nccl" and not 0 <= local < gpus:
        raise SpecError(
            f"field 'ddp.backend': nccl needs a GPU for each process of a node, and process {local} "
            f"of this node's {local_world} sees {gpus} GPU(s): set nproc_per_node to at most {gpus}, "
            "or use auto (gloo on CPU when the GPUs are too few)"
        )
    device = f"cuda:{local}" if chosen == "nccl" else "cpu"
    store_addr = ""
    if under and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        store_addr = f"{env['MASTER_ADDR']}:{_int(env, 'MASTER_PORT', 0)}"
    return DistInfo(
        rank=rank,
        world_size=world,
        local_rank=local,
        backend=chosen,
        device=device,
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        under_torchrun=under,
        store_addr=store_addr,
        run_id=env.get("TORCHELASTIC_RUN_ID", ""),
    )


def backend_note(env: Mapping[str, str], info: DistInfo, *, backend: str, gpus: int) -> str | None:
    """Why a node that sees GPUs trains on CPU (``backend`` auto with fewer GPUs than processes),
    for the run record; None otherwise."""
    if backend != "auto" or gpus == 0 or info.backend != "gloo":
        return None
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
    return (
        f"ddp.backend auto: this node runs {local_world} processes and sees {gpus} GPU(s); NCCL "
        "needs one per process, so the job trains on CPU with gloo (set nproc_per_node to at most "
        f"{gpus} to train on the GPUs)"
    )


def start_group(info: DistInfo, *, timeout_s: float, on_timeout: Callable[[str], None] = exit_now) -> int:
    """Create the default process group and agree on its generation (:func:`agree_generation`),
    all within ``timeout_s``; past it ``on_timeout`` gets one line saying what was waited for
    (the default writes it to stderr and exits 1). Returns the generation."""
    with Watchdog(timeout_s, rank=info.rank, on_expire=on_timeout) as watch:
        init_group(info, timeout_s=timeout_s, watch=watch)
        watch.stage("rank 0's generation number (a broadcast on the new group)")
        try:
            return agree_generation(info.device)
        except RuntimeError as exc:  # torch's DistError and its timeouts
            raise watch.failed(exc) from exc


def init_group(info: DistInfo, *, timeout_s: float = 300.0, watch: Watchdog | None = None) -> None:
    """Create the default process group (idempotent): under torchrun on this round's own prefix
    of torchrun's store (see the module docstring), within ``timeout_s``."""
    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(info.device))
    if not info.under_torchrun:
        dist.init_process_group(backend="gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    if not info.store_addr:
        raise SpecError(
            "environment variables MASTER_ADDR and MASTER_PORT are not both set: start the worker "
            "with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (or none of them)"
        )
    if watch is None:
        with Watchdog(timeout_s, rank=info.rank) as own:
            return init_group(info, timeout_s=timeout_s, watch=own)
    try:
        _create(info, timeout, watch)
    except RuntimeError as exc:  # torch's DistError (store timeouts, gloo's connectFullMesh)
        raise watch.failed(exc) from exc


def _create(info: DistInfo, timeout: datetime.timedelta, watch: Watchdog) -> None:
    left = watch.stage(f"the store at {info.store_addr}")
    # torchrun's store, opened as init_process_group("env://") would open it.
    store, _, _ = next(dist.rendezvous("env://", timeout=datetime.timedelta(seconds=left)))
    left = watch.stage(f"the other {info.world_size - 1} rank(s) to agree on this round's store prefix")
    base = f"{ROUND_PREFIX}/{info.run_id or 'none'}"
    token = agree_round(store, rank=info.rank, world_size=info.world_size, base=base, timeout_s=left)
    watch.stage(f"the {info.backend} process group of {info.world_size} ranks to form")
    store.set_timeout(timeout)
    dist.init_process_group(
        backend=info.backend,
        store=dist.PrefixStore(f"{base}/{token}", store),
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
    )


def agree_generation(device: str = "cpu") -> int:
    """A number all ranks of this group share and no earlier group of the job had: rank 0's
    clock in milliseconds, broadcast. Not TORCHELASTIC_RESTART_COUNT: an agent that joins later,
    or restarts for a membership change, counts differently from the others (pytorch#135712),
    and ranks that disagree on the generation never complete a save or a restore. ``device``:
    the group's (``DistInfo.device``); NCCL has no CPU backend, and a CPU tensor broadcast on it
    fails every job of more than one GPU rank at start-up."""
    value = torch.tensor([time.time_ns() // 1_000_000], dtype=torch.int64, device=device)
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
