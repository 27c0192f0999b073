"""Sizes that pass the schema but cannot run are one line naming the field, before anything is
allocated (data.samples 5e7 with the default MLP would otherwise die in the worker with
numpy's _ArrayMemoryError, a traceback, exit 1)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from worker.datapath import sizing
from worker.datapath.datasets import build_data
from worker.errors import SpecError
from worker.jobspec.spec import DataSpec, ModelSpec
from worker.start.models import build_model

GIB = 1 << 30


def test_a_built_in_set_larger_than_memory_is_refused_with_the_largest_that_fits() -> None:
    with pytest.raises(SpecError, match=r"field 'data\.samples': 50000000 samples .* at most (\d+)") as err:
        sizing.check_builtin_fits(
            "synthetic", 5 * 10**7, {}, field="data.samples", available=2 * GIB, processes=2
        )
    assert "each of the 2 processes" in str(err.value)
    fits = int(str(err.value).split("at most ")[1].split()[0])
    sizing.check_builtin_fits("synthetic", fits, {}, field="data.samples", available=2 * GIB, processes=2)
    with pytest.raises(SpecError):
        sizing.check_builtin_fits(
            "synthetic", fits * 2, {}, field="data.samples", available=2 * GIB, processes=2
        )


def test_the_estimate_follows_the_options() -> None:
    small = sizing.builtin_bytes("tokens", 1000, {"seq_len": 16})
    assert sizing.builtin_bytes("tokens", 1000, {"seq_len": 1024}) > 50 * small
    assert sizing.builtin_bytes("synthetic", 1000, {"input_dim": 4096}) > 50 * sizing.builtin_bytes(
        "synthetic", 1000, {}
    )


def test_nothing_is_refused_when_memory_is_unknown_or_ample(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "available_memory", lambda: None)  # no /proc: no check
    sizing.check_builtin_fits("synthetic", 10**9, {}, field="data.samples", processes=1)
    sizing.check_builtin_fits("synthetic", 4096, {}, field="data.samples", available=64 << 20, processes=8)


def test_available_memory_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 16000000 kB\nMemAvailable: 8000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert sizing.available_memory(meminfo, cgroup) == 8000000 * 1024
    (cgroup / "memory.max").write_text(f"{2 * GIB}\n")
    (cgroup / "memory.current").write_text(f"{GIB // 2}\n")
    assert sizing.available_memory(meminfo, cgroup) == GIB + GIB // 2
    (cgroup / "memory.max").write_text("max\n")  # no limit
    assert sizing.available_memory(meminfo, cgroup) == 8000000 * 1024
    assert sizing.available_memory(tmp_path / "none", tmp_path / "none") is None


def test_build_data_refuses_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "available_memory", lambda: GIB)
    spec = DataSpec(name="synthetic", samples=5 * 10**7)
    with pytest.raises(SpecError, match=r"field 'data\.samples'.*GiB"):
        build_data(spec, seed=0)
    with pytest.raises(SpecError, match=r"field 'data\.eval_samples'"):
        build_data(DataSpec(name="tokens", eval_samples=10**9), seed=0, split="eval")


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("oom_factories")

    def data(samples: Any, seed: int, split: str) -> Any:
        raise MemoryError("Unable to allocate 9.31 GiB for an array with shape (50000000, 50)")

    def model(meta: dict[str, Any]) -> Any:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:116] DefaultCPUAllocator: can't allocate memory")

    def broken(meta: dict[str, Any]) -> Any:
        raise RuntimeError("some other failure")

    module.data, module.model, module.broken = data, model, broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "oom_factories", module)
    return module


def test_running_out_of_memory_while_building_is_one_line(factories: types.ModuleType) -> None:
    with pytest.raises(SpecError, match=r"field 'data\.samples': ran out of memory"):
        build_data(DataSpec(factory="oom_factories:data"), seed=0)
    with pytest.raises(SpecError, match=r"field 'model\.kwargs': ran out of memory"):
        build_model(ModelSpec(factory="oom_factories:model"), {})
    with pytest.raises(RuntimeError, match="some other failure"):  # not an allocation: unchanged
        build_model(ModelSpec(factory="oom_factories:broken"), {})
