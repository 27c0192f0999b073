"""The host waits for the device once per step.

No GPU here, so the step runs on PyTorch's ``meta`` device instead: tensors with shapes and no
memory the host can read. Any read of a device value there (``.item()``, ``float()``, ``bool()``,
``.tolist()``, ``.cpu()``...) raises, except through :func:`worker.train.step.to_host`, the step's one
read, which this test replaces by a counter that returns zeros (a finite, not-skipped step). On a
GPU each of those reads is a wait for every kernel queued before it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from worker.datapath.datasets import tokens
from worker.datapath.feed import Feed
from worker.datapath.sampler import SamplerState
from worker.jobspec.spec import LossScaleSpec, ModelSpec
from worker.start.models import build_model
from worker.start.parts import Wrapped
from worker.train import step
from worker.train.amp import DynamicLossScaler
from worker.train.monitor import GradMonitor
from worker.train.objective import Objective

META = torch.device("meta")


class Replicated(nn.Module):
    """The DDP interface the step uses (``no_sync``), without a process group."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Any) -> Any:
        return self.module(x)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        yield


@pytest.mark.parametrize("measure", [False, True])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_step_of_four_micro_steps_reads_the_device_once(
    monkeypatch: pytest.MonkeyPatch, measure: bool, optimizer: str
) -> None:
    reads: list[int] = []

    def counted(values: torch.Tensor) -> list[float]:
        reads.append(values.numel())
        return [0.0] * values.numel()

    monkeypatch.setattr(step, "to_host", counted)
    data = tokens(64, 0, vocab_size=16, seq_len=8)
    model = build_model(ModelSpec(name="tiny-gpt"), data.meta).to(META)
    params = list(model.parameters())
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=1e-3)
        if optimizer == "adamw"
        else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    )
    feed = Feed(data, seed=0, rank=0, world_size=1, micro_batch=4, accum_steps=4, device=META)
    monitor = GradMonitor([str(i) for i in range(len(params))], stale_after=3)
    scaler = DynamicLossScaler(LossScaleSpec(), enabled=False)
    state = SamplerState()
    for _ in range(2):  # the second step too: the optimizer's moments exist then
        window = feed.plan(state)
        loss, count = step.forward_backward(
            Wrapped(Replicated(model), fsdp=False),
            feed.batches(state, window),
            micro_steps=len(window.micro_steps),
            weight=1 / window.samples,
            objective=Objective(task="lm"),
            precision="fp32",
            scale=scaler.scale,
            device=META,
        )
        assert loss.device == META and count == 16 and len(window.micro_steps) == 4
        result = step.optimizer_step(
            params, opt, scaler, lr=1e-3, clip=1.0, loss_sum=loss, monitor=monitor, measure=measure,
            votes=(1.0,),  # a time-based save policy's vote travels with the flag
        )  # fmt: skip
        assert not result.skipped and (result.stats is not None) == measure
        state = window.after
    # one read a step: [non-finite flag, loss sum, vote], plus the zero runs and 2 statistics
    assert reads == [3 + (len(params) + 2 if measure else 0)] * 2
