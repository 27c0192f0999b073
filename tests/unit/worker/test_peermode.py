"""Peer mode's start from the service's launch environment (worker.peer.member), the reporter that
follows the group's rank 0 and its recoveries' leader (worker.report.service_client.EventForwarder,
worker.report.events.Events.record), and the spec fields that choose the mode (worker.jobspec.recovery)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.specs import raw_spec
from worker.errors import SpecError
from worker.jobspec.recovery import effective_mode, restart_note
from worker.jobspec.spec import parse_spec
from worker.peer import member as peermode
from worker.peer.loop import keeps_save_in_flight, merge_slots
from worker.recovery.failure import Failure
from worker.recovery.seam import Outcome
from worker.report.events import Events
from worker.report.service_client import EventForwarder
from worker.start.dist import DistInfo

RAW: dict[str, Any] = raw_spec("peer", micro_batch_size=4, nodes="1:3", initial_nodes=2, nproc_per_node=2)
INFO = DistInfo(0, 2, 0, "gloo", "cpu", 0, True)
ENV = {
    "ELASTRAIN_JOB_ID": "job-1",
    "ELASTRAIN_WORKER_TOKEN": "token-of-the-job",
    "ELASTRAIN_ETCD_ENDPOINTS": "http://127.0.0.1:2379,http://localhost:2380",
}


def test_the_group_is_sized_from_nodes_and_processes_per_node() -> None:
    cfg = peermode.config(parse_spec(RAW), INFO, ENV, spec_hash="h", timeout_s=7.0)
    assert (cfg.policy.min_world, cfg.policy.max_world, cfg.policy.unit) == (2, 6, 2)
    assert cfg.desired_world == 4 and cfg.collective_timeout_s == 7.0 and cfg.job_id == "job-1"
    assert cfg.advertise == "127.0.0.1", "etcd on loopback: the workers are on one machine"
    assert peermode.advertise(ENV | {"ELASTRAIN_NODE_ADDR": "10.1.2.3"}) == "10.1.2.3"


def test_the_control_secret_is_the_jobs_and_not_the_token_itself() -> None:
    a, b = peermode.secret("token-a"), peermode.secret("token-b")
    assert len(a) == 32 and a != b and a == peermode.secret("token-a") and b"token-a" not in a


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"ELASTRAIN_JOB_ID": ""}, "ELASTRAIN_JOB_ID"),
        ({"ELASTRAIN_WORKER_TOKEN": ""}, "ELASTRAIN_WORKER_TOKEN"),
        ({"ELASTRAIN_ROLE": "captain"}, "ELASTRAIN_ROLE"),
    ],
)
def test_a_bad_launch_environment_is_named(env: dict[str, str], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        peermode.role(ENV | env)
        peermode.config(parse_spec(RAW), INFO, ENV | env, spec_hash="h", timeout_s=1.0)


def test_auto_is_peer_only_for_ddp_under_the_service() -> None:
    assert effective_mode("auto", parallelism="ddp", under_service=True) == "peer"
    assert effective_mode("auto", parallelism="ddp", under_service=False) == "restart"
    assert effective_mode("auto", parallelism="fsdp", under_service=True) == "restart"
    assert effective_mode("peer", parallelism="ddp", under_service=True) == "peer"
    assert effective_mode("peer", parallelism="ddp", under_service=False) == "restart"
    assert effective_mode("restart", parallelism="ddp", under_service=True) == "restart"
    # a job asking for GPUs: peer recovery over NCCL is untested, restart unless asked by name
    assert effective_mode("auto", parallelism="ddp", under_service=True, gpus=True) == "restart"
    assert effective_mode("peer", parallelism="ddp", under_service=True, gpus=True) == "peer"


def test_peer_asked_for_under_a_bare_torchrun_says_the_restart_path_runs() -> None:
    note = restart_note("peer", launched_peer=False)
    assert note is not None and "torchrun's restart" in note and "elastrain serve" in note
    assert restart_note("peer", launched_peer=True) is None
    assert restart_note("auto", launched_peer=False) is None


def test_peer_recovery_with_fsdp_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"field 'recovery.mode'.*ddp"):
        parse_spec(RAW | {"parallelism": "fsdp", "recovery": {"mode": "peer"}})


class Client:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []

    def set_step(self, step: int) -> None:
        pass

    def event(self, kind: str, **fields: Any) -> None:
        self.sent.append((kind, fields))

    def progress(self, **fields: Any) -> None:
        self.sent.append(("progress", fields))


def test_only_the_groups_rank_0_reports_and_the_seat_follows_the_group() -> None:
    client = Client()
    forward = EventForwarder(client, rank=-1, world_size=1, env={})  # type: ignore[arg-type]
    forward("first_step", {"step": 3})
    assert client.sent == [], "a process without a rank of the group reports nothing"
    forward.rank, forward.world_size = 0, 3  # re-seated on a re-formation
    forward("progress", {"step": 4, "samples_seen": 8, "samples_per_second": 1.0})
    forward("spare_promoted", {"launch_id": "job-1-n2-a0", "node_index": 1, "rank": 1})
    assert client.sent[0][1]["world_size"] == 3
    assert client.sent[1] == ("spare_promoted", {"launch_id": "job-1-n2-a0", "node_index": 1, "rank": 1})


def test_a_recovery_is_reported_by_its_leader_whatever_its_rank() -> None:
    """Rank 0 was lost and its replacement took rank 0 again: the survivor that led the recovery
    is rank 1, and its report reaches the service (the other events stay rank 0's)."""
    client = Client()
    forward = EventForwarder(client, rank=1, world_size=2, env={})  # type: ignore[arg-type]
    forward("first_step", {"step": 3})
    forward("recovery", {"phase": "started", "incident": "job-1/g0", "rank": 1})
    forward("spare_promoted", {"launch_id": "job-1-n2-a0", "node_index": 0, "rank": 0})
    assert [kind for kind, _ in client.sent] == ["recovery", "spare_promoted"]


def test_a_record_is_written_whatever_the_rank(tmp_path: Path) -> None:
    """Events.record writes what only this process knows (the leader's incident) to the run's
    event log even where this rank says nothing else."""
    events = Events(enabled=False, job="job", rank=1)
    events.log_path = tmp_path / "events.jsonl"
    seen: list[str] = []
    events.sinks.append(lambda name, fields: seen.append(name))
    events.emit("progress", step=1)
    events.record("recovery_incident", incident="g0", lost_launch_ids=["job-n0-a0"])
    rows = [json.loads(line) for line in events.log_path.read_text().splitlines()]
    assert [r["event"] for r in rows] == ["recovery_incident"] and rows[0]["incident"] == "g0"
    assert seen == ["progress", "recovery_incident"], "sinks see both"


@pytest.mark.parametrize(
    ("outcome", "failure", "keeps"),
    [
        (Outcome("peer", attempts=1), Failure.planned(), True),  # a join: every old member is in
        (Outcome("peer", attempts=1, lost=("b",)), Failure.planned(), False),  # a planned leave
        (Outcome("peer", attempts=2), Failure.planned(), False),  # a loss interrupted the join
        (Outcome("storage", attempts=1), Failure.planned(), False),
        (Outcome("peer", attempts=1), Failure("crash", 0.0, "a member is gone"), False),
        (Outcome("peer", attempts=1), None, False),  # this process's own join: no save of its own
    ],
    ids=["join", "leave", "retried", "storage", "loss", "newcomer"],
)
def test_only_a_join_waits_for_the_old_generations_save(
    outcome: Outcome, failure: Failure | None, keeps: bool
) -> None:
    assert keeps_save_in_flight(outcome, failure) is keeps


def test_a_promoted_spare_keeps_the_slot_it_filled_across_later_reads() -> None:
    first = merge_slots({}, {"a": 0, "b": 1, "spare": 7})  # the spare registered as node 7
    assert first == {"a": 0, "b": 1, "spare": 7}
    promoted = first | {"spare": 1}  # b was lost; the spare took slot 1
    later = merge_slots(promoted, {"a": 0, "spare": 7, "new": 8})  # the next generation's read
    assert later == {"a": 0, "b": 1, "spare": 1, "new": 8}
