"""The local scheduler and this machine's GPUs (service.launch.gpus): a job of several node apps
trains on CPU rather than have its nodes take the same GPUs (NCCL refuses two ranks on one); a job
of one node keeps them. The GPU count is a plain value here; on a GPU, tests/gpu runs the jobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.launch import gpus, hostgpus
from service.launch.apps import SchedulerSettings, local_node_app
from service.launch.protocol import NodeLaunch
from tests.specs import raw_spec
from worker.errors import SpecError
from worker.jobspec.spec import JobSpec, parse_spec


def spec(**overrides: Any) -> JobSpec:
    raw: dict[str, Any] = raw_spec("g", nodes="1", nproc_per_node=2) | overrides  # fmt: skip
    return parse_spec(raw)


@pytest.mark.parametrize(
    ("over", "places"),
    [
        ({}, 1),
        ({"nodes": "1:3"}, 3),  # a scale-up adds node apps on the same machine
        ({"nodes": "2"}, 2),
        ({"spares": 1}, 2),  # a warm spare is a node app too (peer mode, the DDP default)
        ({"spares": 1, "recovery": {"mode": "peer"}, "nodes": "2"}, 3),
    ],
)
def test_node_places_count_every_node_app_that_can_run_at_once(over: dict[str, Any], places: int) -> None:
    assert gpus.node_places(spec(**over)) == places


def test_a_job_of_several_node_apps_is_kept_off_the_gpus_and_told_why() -> None:
    several = spec(nodes="1:3")
    reason = gpus.hidden_reason(several, 2)
    assert reason is not None
    assert "3 node apps on one machine" in reason and 'submit nodes "1" with nproc_per_node up to 2' in reason
    assert gpus.hide(several, 2) == {"CUDA_VISIBLE_DEVICES": ""}
    # no GPU here, one node app, or the team's own CUDA_VISIBLE_DEVICES: nothing hidden
    assert gpus.hidden_reason(several, 0) is None and gpus.hide(several, 0) == {}
    assert gpus.hidden_reason(spec(), 2) is None and gpus.hide(spec(), 2) == {}
    own = spec(nodes="1:3", env={"CUDA_VISIBLE_DEVICES": "0"})
    assert gpus.hidden_reason(own, 2) is None and gpus.hide(own, 2) == {}


def test_nccl_by_name_for_a_job_kept_off_the_gpus_is_refused_naming_the_field() -> None:
    with pytest.raises(
        SpecError, match=r"field 'ddp\.backend': nccl cannot run here: .* or use ddp\.backend auto"
    ):
        gpus.check(spec(nodes="2", ddp={"backend": "nccl"}), 1)
    gpus.check(spec(ddp={"backend": "nccl"}), 1)  # one node: its workers have the GPU
    gpus.check(spec(nodes="2"), 1)  # auto: trains on CPU, said at submit


def test_the_local_node_app_hides_the_gpus_from_a_job_of_several_nodes() -> None:
    settings = SchedulerSettings(rdzv_endpoint="http://127.0.0.1:2379", host_gpus=1)

    def env_of(job: JobSpec) -> dict[str, str]:
        app = local_node_app(
            NodeLaunch("j", job, 0, "j-n0-a0", {}), settings, node_dir="/n", spec_path="/n/spec.json",
            python="python", workdir="/w", import_root="/r",
        )  # fmt: skip
        return dict(app.roles[0].env)

    assert env_of(spec(nodes="2"))["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in env_of(spec())


@pytest.mark.parametrize(
    ("env", "entries", "seen"),
    [
        ({}, 2, 2),  # the driver's GPUs
        ({}, 0, 0),
        ({"CUDA_VISIBLE_DEVICES": ""}, 2, 0),
        ({"CUDA_VISIBLE_DEVICES": "1"}, 2, 1),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 2, 3),  # CUDA's own count decides then; its list says 3
        ({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, 2, 1),  # CUDA stops at an invalid entry
        ({"CUDA_VISIBLE_DEVICES": "GPU-f710f3ee,GPU-8a1b"}, 2, 2),
    ],
)
def test_the_host_count_reads_cuda_visible_devices_then_the_driver(
    tmp_path: Path, env: dict[str, str], entries: int, seen: int
) -> None:
    for i in range(entries):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert hostgpus.count(env, tmp_path, tmp_path / "dev") == seen
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (dev / name).touch()
    assert hostgpus.count({}, tmp_path / "absent", dev) == 2  # no driver directory: the GPU devices
    assert hostgpus.count({}, tmp_path / "absent", tmp_path / "none") == 0


def test_what_the_environment_and_the_device_names_say_is_decided_without_the_host() -> None:
    assert gpus.visible({}) is None
    assert gpus.visible({"CUDA_VISIBLE_DEVICES": ""}) == 0
    assert gpus.visible({"CUDA_VISIBLE_DEVICES": "1,0"}) == 2
    assert gpus.nvidia_devices(["nvidia0", "nvidia12", "nvidiactl", "nvidia-uvm", "null"]) == 2
