"""worker.metrics without sockets: what a rank counts, how a node's series are rendered, where
the exporter goes (the export plan), and how local ranks share one endpoint through files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from worker.errors import ElastrainError
from worker.metrics import (
    DEFAULT_PORT,
    DEFAULT_TARGETS_DIR,
    STEP_HISTOGRAM,
    ExportPlan,
    MetricsError,
    RankMetrics,
    WorkerMetrics,
    export_plan,
    families,
)
from worker.metrics.exporter import stale_peer_dirs

LABELS = {"job_id": "j", "rank": "0", "local_rank": "0", "node": "n1"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    for (n, lab), v in samples(text).items():
        if n == name and labels.items() <= dict(lab).items():
            return v
    raise KeyError(name, labels)


def render(snaps: list[dict[str, Any]]) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    class C:
        def collect(self) -> Any:
            return families(snaps)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(C())
    return generate_latest(registry).decode()


def test_steps_accumulate_counters_histogram_and_recent_rates() -> None:
    m = RankMetrics(labels=dict(LABELS))
    for i, seconds in enumerate([0.004, 0.02, 0.02, 3.0]):
        m.step(
            seconds=seconds,
            samples=8,
            tokens=64,
            data_wait_s=0.001,
            comm_s=(0.002, 0.005),
            step=i + 1,
            now=100.0 + i,
        )
    v = m.values
    assert v["elastrain_worker_steps_total"] == 4 and v["elastrain_worker_samples_total"] == 32
    assert v["elastrain_worker_tokens_total"] == 256 and v["elastrain_worker_step"] == 4
    assert v["elastrain_worker_data_wait_seconds_total"] == pytest.approx(0.004)
    assert v["elastrain_worker_comm_exposed_seconds_total"] == pytest.approx(0.008)
    assert v["elastrain_worker_comm_seconds_total"] == pytest.approx(0.02)
    assert v["elastrain_worker_last_step_timestamp_seconds"] == 103.0
    assert v["elastrain_worker_samples_per_second"] == pytest.approx(32 / 3.044)
    text = render([m.snapshot()])
    assert value(text, STEP_HISTOGRAM + "_bucket", le="0.005") == 1
    assert value(text, STEP_HISTOGRAM + "_bucket", le="0.025") == 3
    assert value(text, STEP_HISTOGRAM + "_bucket", le="2.5") == 3
    assert value(text, STEP_HISTOGRAM + "_bucket", le="5.0") == 4
    assert value(text, STEP_HISTOGRAM + "_bucket", le="+Inf") == 4
    assert value(text, STEP_HISTOGRAM + "_count") == 4
    assert value(text, STEP_HISTOGRAM + "_sum") == pytest.approx(3.044)


def test_counters_exist_from_the_start_gauges_only_once_known() -> None:
    text = render([RankMetrics(labels=dict(LABELS)).snapshot()])
    assert value(text, "elastrain_worker_skipped_steps_total", job_id="j", rank="0") == 0
    names = {n for n, _ in samples(text)}
    assert "elastrain_worker_loss" not in names and "elastrain_worker_loss_scale" not in names
    assert not any(n.endswith("_created") for n in names)


def test_progress_fields_are_what_happened_since_the_previous_call() -> None:
    m = RankMetrics(labels=dict(LABELS))
    m.step(seconds=0.1, samples=4, tokens=40, data_wait_s=0.01, comm_s=(0.02, 0.03), step=1, now=1.0)
    m.step(seconds=0.2, samples=4, tokens=40, data_wait_s=0.01, comm_s=(0.02, 0.03), step=2, now=2.0)
    m.values["elastrain_worker_peak_memory_bytes"] = 1024.0
    first = m.take_progress_fields()
    assert first == {
        "step_seconds": [0.1, 0.2],
        "data_wait_seconds": 0.02,
        "comm_exposed_seconds": 0.04,
        "tokens": 80,
        "peak_memory_bytes": 1024,
    }
    assert m.take_progress_fields()["step_seconds"] == []


def test_a_higher_saves_count_stamps_the_publish_time() -> None:
    m = RankMetrics(labels=dict(LABELS))
    m.checkpoint(
        {"elastrain_checkpoint_saves_total": 0.0, "elastrain_checkpoint_bytes_written_total": 0}, now=10.0
    )
    assert m.values["elastrain_checkpoint_last_publish_timestamp_seconds"] == 10.0  # start, none yet
    m.checkpoint({"elastrain_checkpoint_saves_total": 0.0}, now=20.0)
    assert m.values["elastrain_checkpoint_last_publish_timestamp_seconds"] == 10.0
    m.checkpoint(
        {"elastrain_checkpoint_saves_total": 1.0, "elastrain_checkpoint_last_blocking_seconds": 0.5}, now=30.0
    )
    assert m.values["elastrain_checkpoint_last_publish_timestamp_seconds"] == 30.0
    text = render([m.snapshot()])
    kinds = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert kinds["elastrain_checkpoint_saves"] == "counter"  # the parser drops _total from the family
    assert kinds["elastrain_checkpoint_last_blocking_seconds"] == "gauge"


def test_several_ranks_render_as_one_family_each_with_rank_labels() -> None:
    snaps = []
    for rank in range(3):
        m = RankMetrics(labels={**LABELS, "rank": str(rank), "local_rank": str(rank)})
        m.values["elastrain_worker_loss"] = 1.0 + rank
        snaps.append(m.snapshot())
    text = render(snaps)
    assert text.count("# TYPE elastrain_worker_loss gauge") == 1
    assert [value(text, "elastrain_worker_loss", rank=str(r)) for r in range(3)] == [1.0, 2.0, 3.0]


ENV_TORCHRUN = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"}


@pytest.mark.parametrize(
    ("env", "port", "fallback", "targets"),
    [
        ({}, DEFAULT_PORT, True, DEFAULT_TARGETS_DIR),
        ({"ELASTRAIN_METRICS_PORT": "9500"}, 9500, True, DEFAULT_TARGETS_DIR),
        ({"ELASTRAIN_METRICS_PORT": "auto"}, 0, True, DEFAULT_TARGETS_DIR),
        ({"ELASTRAIN_METRICS_TARGETS_DIR": ""}, DEFAULT_PORT, True, None),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "ELASTRAIN_METRICS_PORT": "9400"}, 9400, False, None),
        ({"ELASTRAIN_METRICS_PORT": "0"}, None, True, None),
        ({"ELASTRAIN_METRICS_PORT": "off"}, None, True, None),
    ],
)
def test_export_plan(env: dict[str, str], port: int | None, fallback: bool, targets: str | None) -> None:
    plan = export_plan(env, job="my job", ppid=42, tmp="/t")
    assert plan.port == port and plan.fallback_free_port == fallback
    assert plan.targets_dir == (Path(targets) if targets else None)
    assert plan.peers_dir is None  # a world of one process per node shares nothing


def test_local_ranks_of_one_agent_share_a_directory_and_only_local_rank_0_serves() -> None:
    zero = export_plan(ENV_TORCHRUN, job="my job", ppid=42, tmp="/t")
    one = export_plan({**ENV_TORCHRUN, "LOCAL_RANK": "1"}, job="my job", ppid=42, tmp="/t")
    assert zero.port == DEFAULT_PORT and one.port is None and one.targets_dir is None
    assert zero.peers_dir == one.peers_dir == Path("/t/elastrain-metrics/my_job-agent42")
    assert zero.restart_count == 1
    other_agent = export_plan({**ENV_TORCHRUN, "LOCAL_RANK": "1"}, job="my job", ppid=43, tmp="/t")
    assert other_agent.peers_dir != zero.peers_dir


def test_a_bad_port_is_an_error_that_names_the_variable() -> None:
    with pytest.raises(MetricsError, match="ELASTRAIN_METRICS_PORT='nine'") as err:
        export_plan({"ELASTRAIN_METRICS_PORT": "nine"}, job="j", ppid=1)
    assert isinstance(err.value, ElastrainError)


def _plan(tmp: Path, local_rank: int, restart: int = 0) -> ExportPlan:
    return ExportPlan(
        port=None,
        addr="127.0.0.1",
        fallback_free_port=True,
        targets_dir=None,
        peers_dir=tmp,
        local_rank=local_rank,
        restart_count=restart,
    )


def test_the_serving_rank_renders_its_peers_of_the_same_attempt(tmp_path: Path) -> None:
    now = [100.0]
    peer = WorkerMetrics(
        job="j", rank=5, world_size=4, plan=_plan(tmp_path, 1), node="n", clock=lambda: now[0]
    )
    peer.observe_step(0.5, 8, step=3)
    peer.set_loss(0.25)
    peer.flush()
    stale = WorkerMetrics(job="j", rank=6, world_size=4, plan=_plan(tmp_path, 2, restart=7), node="n")
    stale.flush()  # a file left by an earlier attempt
    server = WorkerMetrics(job="j", rank=4, world_size=4, plan=_plan(tmp_path, 0), node="n")
    text = server.render().decode()
    ranks = {dict(lab)["rank"] for n, lab in samples(text) if n == "elastrain_worker_world_size"}
    assert ranks == {"4", "5"}
    assert value(text, "elastrain_worker_loss", rank="5") == 0.25
    assert value(text, "elastrain_worker_step", rank="5") == 3
    assert value(text, "elastrain_worker_world_size", rank="4") == 4
    server.close()


def test_progress_fields_and_comm_without_a_hook(tmp_path: Path) -> None:
    m = WorkerMetrics(job="j", rank=0, world_size=1, plan=_plan(tmp_path, 0), node="n")
    m.observe_step(0.1, 4, 0, 0.0, comm_s=0.05)
    m.peak_memory(2048)
    fields = m.progress_fields()
    assert fields["comm_exposed_seconds"] == 0.05 and fields["peak_memory_bytes"] == 2048
    assert m.comm.take() == (0.0, 0.0)
    assert m.port is None  # nothing served without a port


def test_a_reseated_rank_is_exported_with_its_new_rank_and_world_size(tmp_path: Path) -> None:
    """Peer mode: after a re-formation the process holds another rank of a group of another size."""
    m = WorkerMetrics(job="j", rank=0, world_size=1, plan=_plan(tmp_path, 0), node="n")
    m.reseat(rank=2, world_size=3)
    m.observe_step(0.1, 4, step=7)
    text = m.render().decode()
    assert value(text, "elastrain_worker_step", rank="2") == 7
    assert value(text, "elastrain_worker_world_size", rank="2") == 3
    assert not [lab for n, lab in samples(text) if n == "elastrain_worker_step" and dict(lab)["rank"] == "0"]
    m.close()


def test_hand_over_directories_of_agents_that_are_gone_are_found(tmp_path: Path) -> None:
    """Local rank 0 removes its own directory at its close; a run killed before that leaves one,
    which the next serving rank on the machine finds by its agent's pid being gone."""
    for name in ("a-agent10", "b_job-agent11", "mine-agent12", "a-agent13", "notes", "x-agentz"):
        (tmp_path / name).mkdir()
    alive = {11, 12}.__contains__  # 10 and 13 are gone
    stale = stale_peer_dirs(tmp_path, keep=tmp_path / "mine-agent12", alive=alive)
    assert [p.name for p in stale] == ["a-agent10", "a-agent13"]
    assert stale_peer_dirs(tmp_path / "missing", keep=tmp_path, alive=alive) == []
