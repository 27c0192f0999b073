"""torchrun agents forming, losing and growing a worker group through the etcd-v3 rendezvous.

Real etcd, real ``torchrun --rdzv-backend etcd-v3`` agents (found through the entry point),
gloo on CPU. Recovery times are printed (run with ``-s``), never asserted.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from tests.integration.rendezvous.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

Events = list[dict[str, Any]]


def steps(events: Events, *, world: int | None = None, restart: int | None = None) -> Events:
    return [
        e
        for e in events
        if e["event"] == "step"
        and (world is None or e["world"] == world)
        and (restart is None or e["restart"] == restart)
    ]


def ranks_seen(events: Events, *, world: int, restart: int | None = None) -> set[int]:
    return {e["rank"] for e in steps(events, world=world, restart=restart)}


def first_time(events: Events, **match: Any) -> float:
    return min(e["time"] for e in steps(events, **match))


def new_steps(events: Events, old_pids: set[int], *, world: int) -> Events:
    """Steps of workers started after ``old_pids`` (an agent restarting for a membership change
    keeps its restart count, so a new attempt is recognised by new worker processes)."""
    return [e for e in steps(events, world=world) if e["pid"] not in old_pids]


def test_two_agents_form_a_world_and_a_killed_worker_restarts_the_group_once(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster(nnodes="1:2")
    # max_restarts=1: if the first restart were lost (pytorch#135712), the job would fail.
    cluster.start_agent(max_restarts=1)
    cluster.start_agent(max_restarts=1)
    events = cluster.wait_for("a world of 2", lambda ev: ranks_seen(ev, world=2) == {0, 1})
    old_pids = {e["pid"] for e in steps(events)}

    victim = next(e for e in reversed(events) if e["rank"] == 1)
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    events = cluster.wait_for(
        "the group to re-form after SIGKILL",
        lambda ev: {e["rank"] for e in new_steps(ev, old_pids, world=2)} == {0, 1},
    )
    reformed = new_steps(events, old_pids, world=2)
    took = max(min(e["time"] for e in reformed if e["rank"] == r) for r in (0, 1)) - killed_at
    print(f"\nworker SIGKILL -> first step of the re-formed world: {took:.2f}s")

    codes = cluster.stop_and_wait()
    assert codes == [0, 0], cluster.logs()
    done = [e for e in cluster.events() if e["event"] == "done"]
    assert sorted((e["rank"], e["world"]) for e in done) == [(0, 2), (1, 2)]
    assert not {e["pid"] for e in done} & old_pids
    assert max(e["restart"] for e in done) == 1, "the killed worker's agent used its one restart"
    assert "connectFullMesh" not in cluster.logs()


def test_losing_a_whole_node_reforms_the_survivor_at_world_size_one(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster(nnodes="1:2")
    cluster.start_agent(max_restarts=2)
    doomed = cluster.start_agent(max_restarts=2)
    events = cluster.wait_for("a world of 2", lambda ev: ranks_seen(ev, world=2) == {0, 1})

    # A lost machine: its agent and its workers die at once.
    node = doomed_node(cluster, events)
    doomed_pids = {e["pid"] for e in steps(events, world=2) if e["node"] == node}
    lost_at = time.time()
    os.killpg(doomed.pid, signal.SIGKILL)
    for pid in doomed_pids:
        os.kill(pid, signal.SIGKILL)
    doomed.wait()
    events = cluster.wait_for("the survivor to re-form alone", lambda ev: bool(steps(ev, world=1)))
    print(f"\nnode loss -> first step at world size 1: {first_time(events, world=1) - lost_at:.2f}s")

    codes = cluster.stop_and_wait()
    assert codes[0] == 0, cluster.logs()
    done = [e for e in cluster.events() if e["event"] == "done"]
    assert [(e["rank"], e["world"]) for e in done] == [(0, 1)]


def doomed_node(cluster: Cluster, events: Events) -> int:
    """The group rank (node) of the second agent: the one whose workers' parent it is."""
    second = cluster.agents[1].pid
    for event in steps(events):
        try:
            with open(f"/proc/{event['pid']}/stat", encoding="ascii") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == second:
            return int(event["node"])
    raise AssertionError("no worker of the second agent found")


def test_a_third_agent_joining_scales_the_world_from_two_to_three(make_cluster: Any) -> None:
    cluster: Cluster = make_cluster(nnodes="1:3")
    cluster.start_agent()
    cluster.start_agent()
    cluster.wait_for("a world of 2", lambda ev: ranks_seen(ev, world=2) == {0, 1})

    joined_at = time.time()
    cluster.start_agent()
    events = cluster.wait_for("a world of 3", lambda ev: ranks_seen(ev, world=3) == {0, 1, 2})
    print(
        f"\nthird agent started -> first step at world size 3: {first_time(events, world=3) - joined_at:.2f}s"
    )

    codes = cluster.stop_and_wait()
    assert codes == [0, 0, 0], cluster.logs()
    done = [e for e in cluster.events() if e["event"] == "done"]
    assert sorted((e["rank"], e["world"]) for e in done) == [(0, 3), (1, 3), (2, 3)]
