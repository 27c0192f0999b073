"""What a scheduler says about a node, from TorchX's states and from a local node's records
(pure), and how the node wrapper reports an exit."""

from __future__ import annotations

from torchx import specs

from service.launch.node_exec import exit_status
from service.launch.protocol import NodeStatus
from service.launch.torchx_scheduler import status_from_app_state, status_from_records


def test_status_from_torchx_states() -> None:
    assert status_from_app_state(specs.AppState.RUNNING).state == "running"
    assert status_from_app_state(specs.AppState.PENDING).state == "running"
    assert status_from_app_state(specs.AppState.SUCCEEDED) == NodeStatus("succeeded", 0)
    assert status_from_app_state(specs.AppState.FAILED).state == "failed"
    assert status_from_app_state(specs.AppState.CANCELLED).state == "failed"
    assert status_from_app_state(None).state == "unknown"


def test_status_from_local_records() -> None:
    node = {"pid": 1, "pgid": 1}
    assert status_from_records(None, None, alive=False, cancelled=False).state == "unknown"
    assert status_from_records(node, None, alive=True, cancelled=False) == NodeStatus("running")
    assert status_from_records(node, {"exit_code": 0}, alive=False, cancelled=False) == NodeStatus(
        "succeeded", 0
    )
    assert status_from_records(node, {"exit_code": 137}, alive=False, cancelled=False) == NodeStatus(
        "failed", 137
    )
    died = status_from_records(node, None, alive=False, cancelled=False)
    assert died.state == "failed" and died.exit_code is None
    assert status_from_records(node, {"exit_code": 1}, alive=False, cancelled=True).message == "cancelled"


def test_exit_status_reports_signals_like_a_shell() -> None:
    assert (exit_status(0), exit_status(3), exit_status(-9), exit_status(-15)) == (0, 3, 137, 143)
