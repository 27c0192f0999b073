"""The straggler-replacement benchmark slows the member that holds slot 1 now, wherever it runs."""

from __future__ import annotations

from typing import Any

from benchmarks.straggler_replace import member


def node(index: int, role: str, phase: str, launch_id: str) -> dict[str, Any]:
    return {"index": index, "role": role, "phase": phase, "launch_id": launch_id}


def test_the_running_member_of_the_slot_is_chosen_not_a_spare_or_an_ended_launch() -> None:
    job = {
        "nodes": [
            node(0, "member", "running", "j-n0-a0"),
            node(1, "member", "lost", "j-n1-a0"),  # replaced under load before the slowdown
            node(2, "spare", "running", "j-n2-a0"),
            node(1, "member", "running", "j-n3-a0"),  # the spare that took slot 1
        ]
    }
    assert member(job, 1) == "j-n3-a0"
    assert member(job, 0) == "j-n0-a0"
    assert member({"nodes": [node(1, "member", "launching", "j-n1-a0")]}, 1) is None
    assert member({"nodes": []}, 1) is None
