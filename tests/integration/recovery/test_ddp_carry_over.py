"""A planned join that keeps the survivors' DDP wrappers (:func:`worker.recovery.rewrap.carry_over`)
trains the same bits as one that wraps afresh and settles (:func:`worker.recovery.rewrap.rewrap`).

Real gloo processes on CPU: two survivors train 4 steps at W=2, a newcomer settles its own DDP in a
private world of one (:func:`worker.recovery.rewrap.prepare`), the three form the next group, the
newcomer gets rank 0's parameters, and the group trains 6 steps at W=3 (gloo's ring adds in an order
that depends on an element's offset in its bucket from W=3 on). The model has many buckets. Run
once per path; every rank's parameters must be equal within a run and between the runs.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
from typing import Any

import pytest

pytestmark = pytest.mark.integration

BUCKET_MB = 1.0  # the model's ~17 MB of gradients in many buckets


def _member(rank: int, path: str, port: int, out: Any) -> None:
    import datetime

    import torch
    import torch.distributed as dist
    from torch import nn

    from worker.recovery import agree
    from worker.recovery.group import teardown
    from worker.recovery.rewrap import NO_LAYOUT, carry_over, layout_digest, prepare, rewrap
    from worker.start.dist import DistInfo
    from worker.start.parts import wrap_ddp

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8)
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timeout)

    def info(r: int, world: int) -> DistInfo:
        return DistInfo(r, world, 0, "gloo", "cpu", 0, r == 0)

    def probe(module: nn.Module) -> torch.Tensor:
        return module(torch.zeros(1, 64)).sum()

    def step(ddp: nn.Module, index: int, world: int) -> None:
        g = torch.Generator().manual_seed(1000 * index + rank)
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if rank < 2:
        dist.init_process_group("gloo", store=dist.PrefixStore("g0/", store), rank=rank, world_size=2,
                                timeout=timeout)  # fmt: skip
        ddp = rewrap(model, info(rank, 2), bucket_cap_mb=BUCKET_MB, forward=probe)
        for index in range(4):
            step(ddp, index, 2)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        ddp = wrap_ddp(model, info(0, 1), bucket_cap_mb=BUCKET_MB)  # as the trainer builds it
        assert layout_digest(ddp) == NO_LAYOUT  # an unsettled wrapper is never carried over
        prepare(ddp, probe)
        assert layout_digest(ddp) != NO_LAYOUT
    teardown()
    next_store = dist.PrefixStore("g1/", store)
    dist.init_process_group("gloo", store=next_store, rank=rank, world_size=3, timeout=timeout)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, 0)
    agreed, keep = agree.agree_digests(True, agree.state_digest(model, optimizer), layout=layout_digest(ddp))
    assert agreed
    if path == "carry":
        assert keep, "the survivors and the prepared newcomer report the same bucket layout"
        carry_over(ddp)
    else:
        del ddp
        ddp = rewrap(model, info(rank, 3), bucket_cap_mb=BUCKET_MB, forward=probe)
    for index in range(4, 10):
        step(ddp, index, 3)
    out.put((rank, agree.state_digest(model, optimizer).hex(), keep))
    del ddp
    teardown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(path: str) -> dict[int, tuple[str, bool]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_member, args=(rank, path, port, out)) for rank in range(3)]
    for proc in procs:
        proc.start()
    try:
        got = [out.get(timeout=240) for _ in procs]
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    assert all(proc.exitcode == 0 for proc in procs), [proc.exitcode for proc in procs]
    return {rank: (digest, keep) for rank, digest, keep in got}


def test_a_carried_over_ddp_trains_the_same_bits_as_a_fresh_wrap() -> None:
    carried = _run("carry")
    fresh = _run("rewrap")
    assert {keep for _, keep in carried.values()} == {True}
    assert len({digest for digest, _ in carried.values()}) == 1, "the replicas disagree after a carry-over"
    assert {digest for digest, _ in carried.values()} == {digest for digest, _ in fresh.values()}
