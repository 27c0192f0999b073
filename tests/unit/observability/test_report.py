"""service.report and service.cli.report on hand-written event streams: attempts, restarts
with their phases and lost steps, latency percentiles, goodput, time to target, scaling, text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from service.cli.report import render_text
from service.report import (
    ReportError,
    Run,
    build_report,
    load_run,
    parse_events,
    percentile,
    scaling,
    split_attempts,
)

T0 = 1000.0


def ev(name: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"event": name, "job": "demo", "time": T0 + t, **fields}


def progress(
    t: float, step: int, *, world: int = 2, batch: int = 32, loss: float = 1.0, **extra: Any
) -> dict[str, Any]:
    return ev(
        "progress",
        t,
        step=step,
        samples_seen=step * batch,
        loss=loss,
        samples_per_second=100.0,
        world_size=world,
        **extra,
    )


def killed_run() -> list[dict[str, Any]]:
    """Attempt 0 reaches step 14 and dies; attempt 1 resumes from step 10 and finishes at 20."""
    events = [ev("checkpoint_none_to_resume", 0.0), ev("run_record", 0.1, world_size=2, restart_count=0)]
    events += [
        progress(
            1.0 + 0.1 * s,
            s,
            loss=1.0 / s,
            step_seconds=[0.1],
            data_wait_seconds=0.01,
            comm_exposed_seconds=0.02,
            tokens=256,
            peak_memory_bytes=1000 + s,
        )
        for s in range(1, 15)
    ]
    events.insert(12, ev("checkpoint_published", 2.05, step=10, bytes=500, persist_seconds=0.2))
    events += [ev("checkpoint_restored", 10.0, step=10), ev("resumed", 10.5, step=10, samples_seen=320)]
    events += [ev("run_record", 10.6, world_size=2, restart_count=1)]
    events += [
        progress(11.0 + 0.1 * (s - 11), s, loss=1.0 / s, step_seconds=[0.1], tokens=256)
        for s in range(11, 21)
    ]
    events += [
        ev("checkpoint_published", 12.0, step=20, bytes=500, persist_seconds=0.4),
        ev("finished", 12.1, step=20),
    ]
    return events


def test_attempts_split_where_a_start_event_follows_training() -> None:
    attempts = split_attempts(killed_run())
    assert len(attempts) == 2
    assert attempts[1][0]["event"] == "checkpoint_restored"
    # Dying before any training event still starts a new attempt at the repeated start event.
    early = [ev("run_record", 0, world_size=1), ev("run_record", 5, world_size=1), progress(6, 1)]
    assert [len(a) for a in split_attempts(early)] == [1, 2]


def test_one_restart_with_phases_steps_lost_and_recovery_time() -> None:
    report = build_report(Run("r", killed_run()))
    assert report["finished"] and report["steps"] == 20 and report["world_sizes"] == [2]
    (restart,) = report["restarts"]
    assert restart["kind"] == "failure"
    assert restart["last_step_before"] == 14 and restart["resumed_step"] == 10 and restart["steps_lost"] == 4
    assert restart["recovery_seconds"] == pytest.approx(11.0 - 2.4)
    # No started/group_formed events: detect and re-form merge into the restore phase.
    assert [p["name"] for p in restart["phases"]] == ["detect+reform+restore", "first_step"]
    assert [p["seconds"] for p in restart["phases"]] == pytest.approx([10.5 - 2.4, 0.5])


def test_a_restart_after_the_replicas_disagreed_says_so() -> None:
    events = killed_run()
    at = next(i for i, e in enumerate(events) if e["event"] == "checkpoint_restored")
    events.insert(at, ev("replica_mismatch", 2.5, step=14, ranks=[0, 1], tensors=["net.0.weight"]))
    (restart,) = build_report(Run("r", events))["restarts"]
    assert restart["kind"] == "replica_mismatch" and restart["steps_lost"] == 4


def test_every_phase_when_the_worker_reports_each() -> None:
    events = killed_run()
    at = next(i for i, e in enumerate(events) if e["event"] == "checkpoint_restored")
    events[at:at] = [ev("started", 5.0), ev("group_formed", 8.0, world_size=2)]
    (restart,) = build_report(Run("r", events))["restarts"]
    assert [(p["name"], p["seconds"]) for p in restart["phases"]] == [
        ("detect", pytest.approx(2.6)),
        ("reform", pytest.approx(3.0)),
        ("restore", pytest.approx(2.5)),
        ("first_step", pytest.approx(0.5)),
    ]


def test_latency_comm_data_wait_memory_and_target() -> None:
    report = build_report(Run("r", killed_run()), target_loss=0.1)
    lat = report["step_seconds"]
    assert lat["count"] == 24 and lat["p50"] == pytest.approx(0.1) and lat["source"].startswith("per step")
    assert report["comm_exposed_seconds"]["total"] == pytest.approx(0.28)
    assert report["comm_exposed_seconds"]["fraction_of_step_time"] == pytest.approx(0.28 / 2.4)
    assert report["data_wait_seconds"]["total"] == pytest.approx(0.14)
    assert report["peak_memory_bytes"] == 1014
    target = report["time_to_target"]
    assert target["reached"] and target["step"] == 10 and target["seconds"] == pytest.approx(2.0)
    assert build_report(Run("r", killed_run()), target_loss=0.001)["time_to_target"]["reached"] is False


def test_goodput_counts_only_steps_that_were_kept() -> None:
    report = build_report(Run("r", killed_run()))
    # 10 kept steps in attempt 0 and 10 in attempt 1, 0.1 s each; wall 12.1 s.
    assert report["goodput"] == pytest.approx(2.0 / 12.1)


def test_checkpoint_summary() -> None:
    ck = build_report(Run("r", killed_run()))["checkpoints"]
    assert ck["published"] == 2 and ck["aborted"] == 0 and ck["bytes_written"] == 1000
    assert ck["persist_seconds_mean"] == pytest.approx(0.3) and ck["interval_steps_mean"] == 10
    assert ck["blocking_seconds_mean"] is None


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5 and percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 95) == pytest.approx(3.85)


def test_scaling_efficiency_strong_and_weak() -> None:
    strong = scaling(
        {
            1: {"samples_per_second": 100.0, "global_batch": 32},
            4: {"samples_per_second": 320.0, "global_batch": 32},
        }
    )
    assert strong[1] == {
        "world_size": 4,
        "samples_per_second": 320.0,
        "kind": "strong",
        "global_batch": 32,
        "efficiency": 0.8,
    }
    weak = scaling(
        {
            2: {"samples_per_second": 200.0, "global_batch": 16},
            4: {"samples_per_second": 300.0, "global_batch": 32},
        }
    )
    assert weak[1]["kind"] == "weak" and weak[1]["efficiency"] == 0.75
    assert scaling({2: {"samples_per_second": 1.0, "global_batch": 1}}) == []


def test_a_rescale_and_runs_at_other_world_sizes_feed_the_scaling_table() -> None:
    events = [ev("run_record", 0, world_size=1)] + [
        progress(1 + s, s, world=1, batch=16) for s in range(1, 5)
    ]
    events += [ev("run_record", 10, world_size=2)] + [
        progress(11 + 0.5 * s, 4 + s, world=2) for s in range(1, 5)
    ]
    report = build_report(Run("r", events))
    assert report["restarts"][0]["kind"] == "rescale" and report["restarts"][0]["world_size_after"] == 2
    rows = {s["world_size"]: s for s in report["scaling"]}
    assert rows[1]["samples_per_second"] == pytest.approx(16.0) and rows[2][
        "samples_per_second"
    ] == pytest.approx(64)
    assert rows[2]["kind"] == "weak" and rows[2]["efficiency"] == pytest.approx(2.0)
    other = Run("o", [progress(1 + s, s, world=4, batch=64) for s in range(1, 4)])
    assert {s["world_size"] for s in build_report(Run("r", events), others=[other])["scaling"]} == {1, 2, 4}


def test_a_finished_run_that_is_run_again_is_not_a_restart() -> None:
    first = [ev("run_record", 0, world_size=1), progress(1, 1, world=1), ev("finished", 2, step=1)]
    again = [ev("run_record", 5, world_size=1), progress(6, 1, world=1), ev("finished", 7, step=1)]
    assert build_report(Run("r", first + again))["restarts"] == []


def test_text_names_every_section() -> None:
    run = Run(
        "r",
        killed_run(),
        run_record={
            "precision": "fp16",
            "precision_table": {"matmul/linear": {"input": "fp16", "accumulate": "fp32", "output": "fp16"}},
            "versions": {"torch": "2.x"},
            "device": "cpu",
            "backend": "gloo",
            "world_size": 2,
            "seed": 3,
            "notes": ["ddp.backend auto: this node runs 2 processes and sees 1 GPU(s); ..."],
        },
    )
    text = render_text(build_report(run, target_loss=0.1))
    for needle in (
        "throughput",
        "p50 100.0 ms",
        "p95",
        "p99",
        "exposed comm   0.280 s",
        "data wait",
        "peak memory",
        "time to loss <= 0.1: 2.0 s (step 10)",
        "restarts       1",
        "#1 failure",
        "4 steps lost",
        "detect+reform+restore",
        "checkpoints    2 published",
        "precision      fp16",
        "matmul/linear",
        "accumulate fp32",
        "torch 2.x",
        "backend gloo, world size 2, seed 3",
        "note: ddp.backend auto: this node runs 2 processes and sees 1 GPU(s)",
    ):
        assert needle in text, needle


def test_load_run_reads_events_record_and_manifests(tmp_path: Path) -> None:
    lines = [json.dumps(e) for e in killed_run()]
    (tmp_path / "events.jsonl").write_text("torchrun noise\n" + "\n".join(lines) + "\n{not json\n")
    (tmp_path / "run-record.json").write_text(json.dumps({"precision": "fp32"}))
    (tmp_path / "step-00000010").mkdir()
    (tmp_path / "step-00000010" / "manifest.json").write_text(
        json.dumps({"step": 10, "world_size": 2, "files": {"a": {"size": 3}, "b": {"size": 4}}})
    )
    run = load_run(tmp_path)
    assert len(run.events) == len(lines) and run.run_record == {"precision": "fp32"}
    report = build_report(run)
    assert report["checkpoints"]["on_disk"] == [{"step": 10, "world_size": 2, "bytes": 7}]
    assert report["precision"] == "fp32"
    with pytest.raises(ReportError, match=r"events\.jsonl"):
        load_run(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "events.jsonl").write_text(json.dumps(ev("run_record", 0)) + "\n")
    with pytest.raises(ReportError, match="no progress events"):
        build_report(load_run(tmp_path / "empty"))


def test_parse_events_keeps_only_event_objects() -> None:
    assert parse_events(['{"event": "x", "time": 1}', '{"time": 1}', "[1]", '{"event": "y"}']) == [
        {"event": "x", "time": 1}
    ]


def peer_run() -> list[dict[str, Any]]:
    """Peer mode: rank 1 is lost after step 12; the survivors and a spare re-form (generation 2,
    the same processes), the state moves from a peer, and training goes on from step 12."""
    events = [ev("run_record", 0.0, world_size=2, restart_count=0)]
    events += [progress(1.0 + 0.1 * s, s) for s in range(1, 13)]
    lost_at = T0 + 2.25
    events += [
        ev("recovery_detected", 2.27, failed_at=lost_at, generation=1),
        ev("group_formed", 2.30, generation=2, rank=0, world_size=2),
        ev("state_transferred", 2.34, generation=2, source_rank=0, bytes=4_800_000),
        ev(
            "recovery_incident", 2.36, incident="g1", kind="peer", lost_launch_ids=["demo-n1-a0"],
            failed_at=lost_at, detected_at=T0 + 2.27, bytes_from_peers=4_800_000, voided_windows=1,
            world_before=2, world_after=2,
            phases={"detected": T0 + 2.27, "formed": T0 + 2.30, "transferred": T0 + 2.34, "ready": T0 + 2.36},
        ),
    ]  # fmt: skip
    events += [progress(2.40 + 0.1 * (s - 13), s) for s in range(13, 21)]
    return [*events, ev("finished", 3.5, step=20)]


def test_a_peer_recovery_is_an_incident_not_a_restart() -> None:
    report = build_report(Run("r", peer_run()))
    assert report["restarts"] == []  # the processes kept running: one attempt
    (incident,) = report["incidents"]
    assert (incident["kind"], incident["lost"], incident["bytes_from_peers"]) == (
        "peer",
        ["demo-n1-a0"],
        4_800_000,
    )
    assert [p["name"] for p in incident["phases"]] == ["detect", "reform", "transfer", "first_step"]
    assert incident["recovery_seconds"] == pytest.approx(2.40 - 2.25)
    text = render_text(report)
    assert "peer incident #1 g1" in text and "from peers 4.58 MiB" in text


def test_the_service_view_shows_each_incident() -> None:
    from service.cli.report import _service_view

    record = {
        "state": "RUNNING",
        "recovery_mode": "peer",
        "restarts": 0,
        "recoveries": [
            {
                "incident": "j/g5", "kind": "peer", "reason": "peer recovery of j-n1-a0", "lost": ["j-n1-a0"],
                "lost_ranks": [1], "failed_at": 100.0, "detected_at": 100.02, "group_formed_at": 100.05,
                "state_loaded_at": 100.09, "first_step_at": 100.15, "seconds": 0.15, "steps_lost": 0,
                "bytes_from_peers": 4_800_000, "bytes_from_storage": 0, "voided_windows": 1,
                "world_before": 2, "world_after": 2,
                "phases": [{"name": "detect", "seconds": 0.02}, {"name": "reform", "seconds": 0.03},
                           {"name": "transfer", "seconds": 0.04}, {"name": "first_step", "seconds": 0.06}],
            }
        ],
    }  # fmt: skip
    view = _service_view(record)
    report = build_report(Run("r", killed_run())) | {"service": view}
    text = render_text(report)
    assert "incident #1 j/g5: peer, 0.150 s; lost j-n1-a0 (ranks 1); world 2 -> 2" in text
    assert "phases detect 0.020 s, reform 0.030 s, transfer 0.040 s, first_step 0.060 s" in text
    assert "from peers 4.58 MiB, from storage 0.00 MiB; voided windows 1, rolled-back steps 0" in text


def test_a_peer_job_that_re_forms_at_other_sizes_reports_each_size() -> None:
    """Peer mode keeps its processes through a shrink and two joins (one attempt, no restart):
    the report names every size it ran at and times each on its own steps, not all as the last.
    Each segment runs 10 steps of 0.1 s; the global batch is 32 a rank (weak scaling)."""
    events = [ev("run_record", 0.0, world_size=2, restart_count=0, backend="gloo", device="cpu")]
    t, step, seen = 1.0, 0, 0
    for world, step_s in ((2, 0.1), (1, 0.1), (2, 0.1), (3, 0.2)):
        events.append(ev("group_formed", t, generation=world, rank=0, world_size=world))
        for _ in range(10):
            t, step, seen = t + step_s, step + 1, seen + 32 * world
            events.append(ev("progress", t, step=step, samples_seen=seen, world_size=world, loss=1.0))
        t += 5.0  # the re-formation: in no segment's time
    events.append(ev("finished", t, step=step, world_size=3))
    report = build_report(Run("r", events))
    assert report["restarts"] == [] and report["world_sizes"] == [1, 2, 3]
    rows = report["throughput"]["by_world_size"]
    assert {w: round(r["samples_per_second"]) for w, r in rows.items()} == {1: 320, 2: 640, 3: 480}
    assert rows[2]["steps"] == 18  # two segments of 10 progress events, 9 intervals each
    assert [s["world_size"] for s in report["scaling"]] == [1, 2, 3]
    text = render_text(report)
    assert "world sizes    1, 2, 3" in text
    assert "world size 2 (the latest run record's)" in text  # the only record here: the first group's


def test_every_world_size_a_step_was_trained_at_is_listed_even_without_a_progress_event_there() -> None:
    """A peer job shrinks 2 -> 1 when rank 0 dies: the survivor, rank 1 when the group formed,
    does not write that ``group_formed``, and the few steps at 1 end before a progress event
    (a large log_every_steps); the recovery's record and the batch plan say the size. A group
    formed at 4 that failed before its first step is not a size the run trained at."""
    events = [ev("run_record", 0.0, world_size=2, restart_count=0), ev("first_step", 0.5, step=1)]
    events += [progress(1.0 + s, s, world=2) for s in (10, 20)]
    events += [
        ev("recovery_incident", 25.0, generation=1, world_before=2, world_after=1),
        ev("batch_replanned", 25.1, world_size=1),
        ev("first_step", 25.2, step=21),
        ev("recovery_incident", 27.0, generation=2, world_before=1, world_after=4),
        ev("recovery_incident", 29.0, generation=3, world_before=4, world_after=3),
        ev("group_formed", 29.1, generation=3, rank=0, world_size=3),
        ev("first_step", 29.2, step=24),
    ]
    events += [progress(30.0 + s, s, world=3) for s in (30, 40)]
    events.append(ev("finished", 80.0, step=40, world_size=3))
    report = build_report(Run("r", events))
    assert report["world_sizes"] == [1, 2, 3]
    assert "world sizes    1, 2, 3" in render_text(report)


def test_the_service_view_names_the_last_step_each_lost_rank_completed() -> None:
    from service.cli.report import _service_view

    record = {
        "state": "RUNNING", "recovery_mode": "peer", "restarts": 0,
        "recoveries": [
            {
                "incident": "j/g5", "kind": "peer", "reason": "peer recovery of j-n1-a0", "lost": ["j-n1-a0"],
                "lost_ranks": [1], "last_completed_steps": {"1": 19}, "failed_at": 100.0, "seconds": 8.4,
                "bytes_from_peers": 1, "bytes_from_storage": 0, "voided_windows": 1, "phases": [],
            }
        ],
    }  # fmt: skip
    text = render_text(build_report(Run("r", killed_run())) | {"service": _service_view(record)})
    assert "lost j-n1-a0 (ranks 1; last completed step 19 on rank 1)" in text
