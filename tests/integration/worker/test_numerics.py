"""Data-parallel averaging and accumulation give the gradients of the union batch (real gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integration.launch import REPO, worker_env

pytestmark = pytest.mark.integration
PROBE = Path(__file__).with_name("grad_probe.py")


def probe(tmp: Path, nproc: int, configs: list[dict[str, int]], tag: str) -> dict[int, dict]:
    out = tmp / f"{tag}.pt"
    args = [str(out), json.dumps(configs)]
    if nproc:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(PROBE),
            *args,
        ]
    else:
        cmd = [sys.executable, str(PROBE), *args]
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def grads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    tmp = tmp_path_factory.mktemp("grads")
    # 0: full window; 1: the short, unequal last window of the epoch (10 samples: ranks get 4+1 and 4+1)
    # 2: accumulation A=4 x b=2; 3: one step at b=8 (same 16 samples)
    two = [
        {"b": 4, "a": 2, "cursor": 0},
        {"b": 4, "a": 2, "cursor": 90},
        {"b": 2, "a": 4, "cursor": 0},
        {"b": 8, "a": 1, "cursor": 0},
    ]
    one = [
        {"b": 16, "a": 1, "cursor": 0},
        {"b": 4, "a": 3, "cursor": 90},
        {"b": 2, "a": 4, "cursor": 0},
        {"b": 8, "a": 1, "cursor": 0},
    ]
    return {"w2": probe(tmp, 2, two, "w2"), "w1": probe(tmp, 0, one, "w1")}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")


def test_two_ranks_equal_one_process_on_the_union(grads: dict[str, dict[int, dict]]) -> None:
    assert_same(grads["w2"][0]["grads"], grads["w1"][0]["grads"])


def test_unequal_last_batch_is_weighted_by_sample_count(grads: dict[str, dict[int, dict]]) -> None:
    w2, w1 = grads["w2"][1], grads["w1"][1]
    assert w2["samples"] == w1["samples"] == 10
    assert w2["micro_steps"] == 2  # 8 samples then 2: each rank gets 4 then 1
    assert_same(w2["grads"], w1["grads"])


@pytest.mark.parametrize("world", ["w1", "w2"])
def test_accumulation_equals_one_big_batch(grads: dict[str, dict[int, dict]], world: str) -> None:
    assert grads[world][2]["micro_steps"] == 4 and grads[world][3]["micro_steps"] == 1
    assert_same(grads[world][2]["grads"], grads[world][3]["grads"])
