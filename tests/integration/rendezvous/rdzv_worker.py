"""A tiny torchrun worker for the rendezvous tests: all-reduces on gloo until told to stop.

Each step appends one JSON line to ``$RDZV_TEST_OUT`` (pid, node, rank, world size, restart
count, time), so a test can see which world formed, kill a worker by pid, and measure how long
the group took to come back. The group stops together at the first step after
``$RDZV_TEST_STOP`` exists (the flag is all-reduced so every rank stops at the same step).
``RDZV_TEST_IGNORE_SIGTERM=1`` makes it ignore SIGTERM (to test a cancel's SIGKILL escalation).
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch
import torch.distributed as dist


def record(path: str, event: str, **fields: object) -> None:
    line = {
        "event": event,
        "pid": os.getpid(),
        "node": int(os.environ["GROUP_RANK"]),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
        "time": time.time(),
        **fields,
    }
    with open(path, "a", encoding="utf-8") as out:  # O_APPEND: one write per line
        out.write(json.dumps(line) + "\n")


def main() -> None:
    out, stop = os.environ["RDZV_TEST_OUT"], os.environ["RDZV_TEST_STOP"]
    if os.environ.get("RDZV_TEST_IGNORE_SIGTERM") == "1":  # a worker stuck past a cancel
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(int(os.environ.get("RDZV_TEST_MAX_STEPS", "3000"))):
        flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        ones = torch.ones(1)
        dist.all_reduce(ones)
        if int(ones.item()) != world:
            raise RuntimeError(f"all_reduce of ones gave {ones.item()}, expected {world}")
        record(out, "step", rank=rank, world=world, step=step)
        if flag.item() > 0:
            break
        time.sleep(0.1)
    record(out, "done", rank=rank, world=world)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
