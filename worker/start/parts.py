"""Building a run: seeds and determinism flags, data, model, DDP, optimizer, the run record."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from worker.jobspec.spec import JobSpec, OptimizerSpec, spec_json
from worker.start.dist import DistInfo
from worker.start.threads import record as threads_record
from worker.train.amp import precision_table
from worker.train.schedule import BatchPlan


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A per-rank stream (dropout and the like) that differs between ranks but not between runs."""
    digest = hashlib.blake2b(f"{seed}/{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def set_determinism(enabled: bool) -> dict[str, Any]:
    """Deterministic algorithms and the flags that matter; returns what was set for the run record."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled
    return {
        "deterministic": enabled,
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn.deterministic": torch.backends.cudnn.deterministic,
        "cudnn.benchmark": torch.backends.cudnn.benchmark,
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def wrap_ddp(
    model: nn.Module, info: DistInfo, *, bucket_cap_mb: float, init_sync: bool = True
) -> DistributedDataParallel:
    """``init_sync=False`` skips DDP's broadcast of rank 0's parameters and buffers at
    construction: for a group whose members already agreed on the state by digest (peer mode)."""
    device_ids = [torch.device(info.device).index] if info.device.startswith("cuda") else None
    return DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,
        init_sync=init_sync,
    )


class Wrapped:
    """The module the training loop calls, and how to hold back gradient sync for a micro-step."""

    def __init__(self, module: nn.Module, *, fsdp: bool) -> None:
        self.module = module
        self.fsdp = fsdp

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if not self.fsdp:
            with self.module.no_sync():  # type: ignore[operator]
                yield
            return
        self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)  # type: ignore[operator]


def wrap(model: nn.Module, info: DistInfo, *, parallelism: str, bucket_cap_mb: float) -> Wrapped:
    """DDP (replicated state) or FSDP2 ``fully_shard`` (parameters and optimizer state sharded).

    FSDP shards every member of an ``nn.ModuleList`` (the transformer blocks) and then the root.
    Both average gradients over the ranks, which the loss weighting in :mod:`worker.train.step` relies on.
    """
    if parallelism == "ddp":
        return Wrapped(wrap_ddp(model, info, bucket_cap_mb=bucket_cap_mb), fsdp=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(info.device).type, (info.world_size,))
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Wrapped(model, fsdp=True)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view), or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def build_optimizer(model: nn.Module, cfg: OptimizerSpec) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


# Where and how a job runs, not what it computes: left out of the training configuration's hash,
# so that the same training under the service and under bare torchrun has the same state digest.
OPERATIONAL_FIELDS = frozenset(
    {"name", "checkpoint", "nodes", "initial_nodes", "nproc_per_node", "max_restarts", "resources",
     "log_every_steps", "monitor", "integrity", "stragglers", "preemption", "recovery", "spares", "priority",
     "queue"}
)  # fmt: skip


def spec_hash(spec: JobSpec) -> str:
    """A hash of the training configuration (the spec less :data:`OPERATIONAL_FIELDS`)."""
    raw = {k: v for k, v in json.loads(spec_json(spec)).items() if k not in OPERATIONAL_FIELDS}
    return hashlib.blake2b(json.dumps(raw, sort_keys=True).encode(), digest_size=16).hexdigest()


def run_record(
    spec: JobSpec,
    info: DistInfo,
    *,
    plan: BatchPlan,
    flags: dict[str, Any],
    notes: list[str],
    state: dict[str, list[str]],
) -> dict[str, Any]:
    """Everything needed to say how this run computed: versions, world, numerics, the spec.
    ``state``: the master state's real dtypes (:func:`worker.train.amp.state_dtypes`)."""
    device = torch.device(info.device)
    return {
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "cuda": torch.version.cuda,
            "platform": platform.platform(),
        },
        "device": info.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "world_size": info.world_size,
        "threads": threads_record(
            os.environ,
            job_env=spec.env,
            intra_op=torch.get_num_threads(),
            inter_op=torch.get_num_interop_threads(),
        ),
        "backend": info.backend,
        "restart_count": info.restart_count,
        "ddp": {"bucket_cap_mb": spec.ddp.bucket_cap_mb, "gradient_reduction": "mean over ranks (DDP)"},
        "reduction": "loss = sum of per-sample losses / global sample count of the window",
        "determinism": flags,
        "seed": spec.seed,
        "batch": plan.to_json(),
        "precision": spec.precision,
        "precision_table": precision_table(spec.precision, device, state),
        "state_dtypes": state,
        "spec": spec.model_dump(mode="json", by_alias=True),
        "spec_hash": spec_hash(spec),
        "data_version": spec.data.version,
        "notes": notes,
    }


def params_digest(model: nn.Module) -> str:
    """A hash of all parameters' bytes in name order: equal runs give equal digests. A tensor
    shared by several names (tied weights) counts once, under the first name the module
    registers for it (``named_parameters`` drops the repeats)."""
    hasher = hashlib.blake2b(digest_size=16)
    params = model.named_parameters(remove_duplicate=True)
    for name, param in sorted(params, key=lambda item: item[0]):
        tensor = param.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.cpu().contiguous()
        hasher.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        hasher.update(tensor.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def shared_parameters(model: nn.Module) -> list[list[str]]:
    """The groups of names that are one tensor (tied weights such as GPT-2's ``lm_head.weight``
    and ``transformer.wte.weight``), each sorted; empty when nothing is shared."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)
