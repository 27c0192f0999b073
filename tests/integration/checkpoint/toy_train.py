"""A toy training job for the checkpoint integration tests; run it under torchrun (gloo, CPU).

Deterministic: the model is initialised from seed 0 on every rank, each step's batch is a
function of (seed, step, rank), and dropout draws from the per-rank torch RNG, so a resumed run
is bitwise identical to an uninterrupted one only if the whole state (RNG included) came back.

Phases: ``train`` (resume per --resume, train to --steps, save every --every and at the end),
``resave`` (load per --resume, save the same step into --dir, then train two more steps),
``restore-only`` (restore from each of --restore-dirs and report what was loaded).
Rank 0 prints one JSON object per line on stdout.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from worker.checkpoint import Checkpointer
from worker.checkpoint.layout import read_latest
from worker.checkpoint.verify import logical_digest, verify_checkpoint
from worker.jobspec.spec import CheckpointSpec
from worker.start.dist import detect, init_group

BATCH = 4
VOCAB = 64
MODEL = "mlp"  # --model


def emit(event: str, **fields: Any) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        sys.stdout.write(json.dumps({"event": event, **fields}, default=str) + "\n")
        sys.stdout.flush()


def gpt2() -> nn.Module:
    """A real third-party model with tied weights (``lm_head.weight`` is
    ``transformer.wte.weight``) and dropout, built from a small config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def build(
    parallelism: str, world: int, kind: str = "mlp"
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """(module to checkpoint, module to call, optimizer)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        return _wrap(gpt2(), parallelism, world, blocks=lambda m: list(m.transformer.h))
    model = nn.Sequential(
        nn.Linear(12, 40), nn.LayerNorm(40), nn.ReLU(), nn.Dropout(0.1),
        nn.Linear(40, 24), nn.BatchNorm1d(24), nn.Linear(24, 5),
    )  # fmt: skip
    return _wrap(model, parallelism, world, blocks=lambda m: [x for x in m if isinstance(x, nn.Linear)])


def _wrap(
    model: nn.Module, parallelism: str, world: int, *, blocks: Any
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    if parallelism == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in blocks(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runner: nn.Module = model
    else:
        runner = nn.parallel.DistributedDataParallel(model)
    return model, runner, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    if MODEL == "gpt2":
        ids = torch.randint(0, VOCAB, (BATCH, 12), generator=g)
        return ids, ids
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 5, generator=g)


def train_step(runner: nn.Module, opt: torch.optim.Optimizer, seed: int, step: int, rank: int) -> float:
    x, y = batch(seed, step, rank)
    loss = runner(input_ids=x, labels=y).loss if MODEL == "gpt2" else nn.functional.mse_loss(runner(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def checkpointer(args: argparse.Namespace, directory: str, resume: str) -> Checkpointer:
    cfg = CheckpointSpec(dir=directory, interval_steps=args.every, async_save=args.async_save, resume=resume)
    return Checkpointer(
        cfg, job=f"toy-{args.parallelism}", spec_hash="toy", data_version="1", rank=dist.get_rank(),
        world_size=dist.get_world_size(), generation=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        parallelism=args.parallelism, seed=args.seed, run_record={"toy": True}, block_size=args.block_size,
        on_event=lambda name, fields: emit(name, **fields),
    )  # fmt: skip


def check_latest(directory: str) -> None:
    """At every start: ``latest`` (if any) names a checkpoint that verifies."""
    if dist.get_rank() != 0 or not Path(directory).is_dir():
        return
    latest = read_latest(Path(directory))
    problems = [str(p) for p in verify_checkpoint(directory)[1]] if latest else []
    emit("latest_check", latest=latest, problems=problems)


def progress(step: int, samples: int) -> dict[str, Any]:
    return {"step": step, "samples_seen": samples, "epoch": 0, "sampler": {"cursor": samples}}


def run_train(
    args: argparse.Namespace, model: nn.Module, runner: nn.Module, opt: torch.optim.Optimizer
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    check_latest(args.dir)
    ck = checkpointer(args, args.dir, args.resume)
    restored = ck.restore(model=model, optimizer=opt)
    start, samples = (restored.step, restored.progress["samples_seen"]) if restored else (0, 0)
    if restored:
        emit("resumed", step=start, path=str(restored.path), rng_restored=restored.rng_restored)
    for step in range(start + 1, args.steps + 1):
        loss = train_step(runner, opt, args.seed, step, rank)
        samples += BATCH * world
        if ck.should_save(step, now=time.time()) or step == args.steps:
            ck.save(
                step=step,
                model=model,
                optimizer=opt,
                progress=progress(step, samples),
                metrics={"loss": loss},
            )
            emit("saved", step=step, latest=read_latest(Path(args.dir)))
    ck.close()
    dist.barrier()
    emit("finished", step=args.steps, digest=logical_digest(args.dir) if rank == 0 else None, stats=ck.stats,
         tied=tied(model))  # fmt: skip


def tied(model: nn.Module) -> bool | None:
    """Whether GPT-2's head is still its embedding (one Parameter); None for other models."""
    if MODEL != "gpt2":
        return None
    return model.lm_head.weight is model.transformer.wte.weight  # type: ignore[union-attr,operator]


def run_resave(args: argparse.Namespace) -> None:
    """For each (parallelism, source, destination): load, save the same step into destination,
    train two more steps."""
    rank = dist.get_rank()
    for parallelism, source, destination in json.loads(args.jobs):
        args.parallelism = parallelism
        model, runner, opt = build(parallelism, dist.get_world_size(), MODEL)
        ck = checkpointer(args, destination, source)
        restored = ck.restore(model=model, optimizer=opt)
        assert restored is not None
        ck.save(step=restored.step, model=model, optimizer=opt, progress=restored.progress, metrics={})
        ck.close()
        dist.barrier()
        notes = [None] * dist.get_world_size()
        dist.all_gather_object(notes, [restored.rng_restored, restored.notes])
        emit("resaved", parallelism=parallelism, source=source, step=restored.step, rng=notes,
             digest=logical_digest(destination) if rank == 0 else None, tied=tied(model))  # fmt: skip
        losses = [train_step(runner, opt, args.seed, restored.step + i, rank) for i in (1, 2)]
        emit("continued", parallelism=parallelism, finite=all(math.isfinite(v) for v in losses))


def run_restore_only(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for directory in args.restore_dirs.split(","):
        check_latest(directory)
        restored = checkpointer(args, directory, "auto").restore(model=model, optimizer=opt)
        emit("restored_from", dir=directory, step=restored.step if restored else None,
             path=str(restored.path) if restored else None)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="")
    parser.add_argument("--parallelism", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--model", choices=["mlp", "gpt2"], default="mlp")
    parser.add_argument("--phase", choices=["train", "resave", "restore-only"], default="train")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--resume", default="auto")
    parser.add_argument("--restore-dirs", default="")
    parser.add_argument("--jobs", default="[]", help='resave: [["ddp", SRC, DST], ...]')
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--watchdog", type=float, default=150.0, help="dump stacks and exit if still running")
    args = parser.parse_args()
    global MODEL
    MODEL = args.model
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    torch.set_num_threads(1)
    # The worker's group creation: torchrun's agent store outlives a restart (pytorch#135712).
    init_group(detect(os.environ, backend="gloo", gpus=0))
    rank = dist.get_rank()
    emit("started", world_size=dist.get_world_size(), attempt=os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    if args.phase == "resave":
        run_resave(args)
    else:
        model, runner, opt = build(args.parallelism, dist.get_world_size(), MODEL)
        random.seed(1000 + rank)
        np.random.seed(1000 + rank)
        torch.manual_seed(1000 + rank)
        if args.phase == "train":
            run_train(args, model, runner, opt)
        else:
            run_restore_only(args, model, opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
