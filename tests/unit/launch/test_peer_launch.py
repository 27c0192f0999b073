"""Peer mode at launch: what a node app runs and is told, as the dry-run values show it,
next to restart mode, which stays as it was."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.launch.apps import SchedulerSettings, node_app
from service.launch.dryrun import LocalLaunch, kubernetes_dryrun, worker_pod
from service.launch.protocol import NodeLaunch
from service.launch.torchx_scheduler import TorchXScheduler
from tests.specs import make_spec

SPEC = make_spec("demo", nodes="1:3", nproc_per_node=2, max_restarts=4)
ENV = {"ELASTRAIN_SERVICE_URL": "http://svc:8080", "ELASTRAIN_ETCD_ENDPOINTS": "http://etcd:2379"}
RESTART = NodeLaunch("job-7", SPEC, 1, "job-7-n1-a0", ENV)
MEMBER = dataclasses.replace(RESTART, recovery="peer")
SPARE = dataclasses.replace(MEMBER, node_index=3, launch_id="job-7-n3-a0", role="spare")
K8S = SchedulerSettings(scheduler="kubernetes", rdzv_endpoint="http://etcd:2379", worker_image="img:1")
PEER_ARGS = [
    *("-m", "torch.distributed.run", "--standalone", "--nnodes=1:1", "--nproc-per-node=2"),
    *("--max-restarts=4", "--shutdown-timeout=25", "--monitor-interval=0.1"),
    *("--module", "worker", "--config", "/s.json"),
]


def args_of(node: NodeLaunch) -> list[str]:
    return list(
        node_app(node, rdzv_endpoint="http://etcd:2379", image="i", spec_path="/s.json").roles[0].args
    )


def test_a_peer_node_runs_a_private_one_node_torchrun() -> None:
    """The contract's command line: no rendezvous shared with other agents, so torchrun's restart
    on a membership change can never stop the survivors on other nodes."""
    assert args_of(MEMBER) == PEER_ARGS
    assert args_of(SPARE) == PEER_ARGS


def test_restart_mode_keeps_the_shared_etcd_rendezvous() -> None:
    args = args_of(RESTART)
    assert "--rdzv-backend=etcd-v3" in args and "--rdzv-id=job-7" in args and "--nnodes=1:3" in args
    assert "--standalone" not in args


def test_a_peer_node_is_told_its_recovery_and_role() -> None:
    member = node_app(MEMBER, rdzv_endpoint="e", image="i", spec_path="/s").roles[0].env
    spare = node_app(SPARE, rdzv_endpoint="e", image="i", spec_path="/s").roles[0].env
    assert member["ELASTRAIN_RECOVERY"] == "peer" and member["ELASTRAIN_ROLE"] == "member"
    assert spare["ELASTRAIN_ROLE"] == "spare" and spare["ELASTRAIN_NODE_INDEX"] == "3"
    assert member["ELASTRAIN_ETCD_ENDPOINTS"] == "http://etcd:2379"
    assert "ELASTRAIN_NODE_ADDR" not in member  # one machine: the worker finds its address
    restart = node_app(RESTART, rdzv_endpoint="e", image="i", spec_path="/s").roles[0].env
    assert not {"ELASTRAIN_RECOVERY", "ELASTRAIN_ROLE"} & set(restart)


def test_a_peer_pod_gets_its_own_ip_as_the_node_address() -> None:
    container = worker_pod(kubernetes_dryrun(MEMBER, K8S))["spec"]["containers"][0]
    addr = [e for e in container["env"] if e["name"] == "ELASTRAIN_NODE_ADDR"]
    assert addr == [{"name": "ELASTRAIN_NODE_ADDR", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    plain = {e["name"]: e.get("value") for e in container["env"]}
    assert plain["ELASTRAIN_RECOVERY"] == "peer" and "--standalone" in container["command"] + container.get(
        "args", []
    )
    restart = worker_pod(kubernetes_dryrun(RESTART, K8S))["spec"]["containers"][0]
    assert all(e["name"] != "ELASTRAIN_NODE_ADDR" for e in restart["env"])


@pytest.fixture
def local(tmp_path: Path) -> Iterator[TorchXScheduler]:
    settings = SchedulerSettings(rdzv_endpoint="http://etcd:2379", log_root=str(tmp_path / "nodes"))
    scheduler = TorchXScheduler(settings)
    yield scheduler
    scheduler.close()


def test_the_local_dry_run_shows_the_peer_command_and_environment(local: TorchXScheduler) -> None:
    plan = local.dryrun(SPARE)
    assert isinstance(plan, LocalLaunch)
    torchrun = plan.command[plan.command.index("--") + 1 :]
    assert torchrun[1:] == [*PEER_ARGS[:-1], str(plan.spec_path)]
    assert plan.env["ELASTRAIN_RECOVERY"] == "peer" and plan.env["ELASTRAIN_ROLE"] == "spare"
    assert plan.env["ELASTRAIN_LAUNCH_ID"] == "job-7-n3-a0"


def test_an_ended_local_node_says_when_its_agent_ended() -> None:
    """The lost node's last sign of life (a recovery is timed from it): node_exec's exit record."""
    from service.launch.torchx_scheduler import status_from_records

    node = {"pid": 1, "pgid": 1, "child_pid": 2, "started_at": 10.0}
    ended = status_from_records(node, {"exit_code": 137, "ended_at": 12.5}, alive=False, cancelled=False)
    assert (ended.state, ended.exit_code, ended.ended_at) == ("failed", 137, 12.5)
    assert status_from_records(node, {"exit_code": 1}, alive=False, cancelled=False).ended_at is None
