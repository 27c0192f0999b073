"""The underflow watch's numbers: the fraction of zero gradient elements, the smallest non-zero
magnitude, and parameters whose gradient stayed zero (or absent) for stale_after steps."""

from __future__ import annotations

import math

import pytest
import torch

from worker.train.monitor import GradMonitor, pending_stats

CPU = torch.device("cpu")


def reference(grads: list[torch.Tensor]) -> tuple[int, float]:
    flat = torch.cat([g.reshape(-1).double() for g in grads])
    nonzero = flat[flat != 0]
    return int(nonzero.numel()), float(nonzero.abs().min()) if nonzero.numel() else math.inf


def tricky() -> list[torch.Tensor]:
    torch.manual_seed(0)
    a = torch.randn(1000) * (torch.rand(1000) > 0.3) * 10 ** torch.randint(-44, 3, (1000,)).float()
    b = torch.tensor([0.0, -0.0, -1e-45, 3.0, -0.0])  # -0.0 is zero; a negative denormal is not
    return [a, b, torch.zeros(7), torch.zeros(0), torch.tensor([2.5, -0.5], dtype=torch.bfloat16)]


@pytest.mark.parametrize("chunk", [None, 3, 64, 4096])
def test_the_statistics_are_exact_through_any_scratch_size(chunk: int | None) -> None:
    grads = tricky()
    scratch = None if chunk is None else torch.empty(chunk, dtype=torch.int32)
    nonzero, smallest = pending_stats(grads, device=CPU, scratch=scratch).tolist()
    assert (nonzero, smallest) == reference(grads)
    assert smallest == pytest.approx(1.401298464324817e-45)  # the denormal, with its sign cleared


def test_all_zero_gradients_have_no_smallest_magnitude() -> None:
    monitor = GradMonitor(["a", "b"], stale_after=2)
    zeros = [torch.zeros(3), torch.zeros(2, 2)]
    values = monitor.pending(zeros, device=CPU).tolist()
    stats = monitor.stats([0.0, 0.0, *values], numel=7)
    assert stats.zero_fraction == 1.0 and stats.min_nonzero == 0.0


def test_a_parameter_without_an_update_signal_for_stale_after_steps_is_stale() -> None:
    monitor = GradMonitor(["moving", "frozen", "absent"], stale_after=3)
    for _ in range(3):
        norms = torch.tensor([1.0, 0.0])  # "absent" got no gradient at all
        monitor.commit(monitor.advance(norms, present=[0, 1]))
    runs = monitor.zero_run.tolist()
    assert runs == [0, 3, 3]
    assert monitor.stats([*map(float, runs), 1.0, 0.5], numel=2).stale_params == ("frozen", "absent")
    assert monitor.state_dict() == {"zero_run": [0, 3, 3]}
