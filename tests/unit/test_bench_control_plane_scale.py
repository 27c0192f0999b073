"""The arithmetic of benchmarks/control_plane_scale.py, on plain values."""

from __future__ import annotations

import math

import pytest

from benchmarks.control_plane_scale import (
    by_label,
    checkpoint_round,
    cost_ratio,
    db_after,
    history_s,
    p99,
    per_pass_ms,
    prom_value,
)

METRICS = """# HELP etcd_mvcc_db_total_size_in_bytes Total size of the underlying database
# TYPE etcd_mvcc_db_total_size_in_bytes gauge
etcd_mvcc_db_total_size_in_bytes 2.097152e+06
elastrain_reconciler_pass_duration_seconds_sum 1.5
elastrain_reconciler_pass_duration_seconds_count 30.0
elastrain_jobs{state="RUNNING"} 4.0
elastrain_jobs{state="SUCCEEDED"} 6.0
elastrain_etcd_requests_total{op="get",outcome="ok"} 7.0
elastrain_etcd_requests_total{op="get",outcome="error"} 1.0
elastrain_etcd_requests_total{op="commit",outcome="ok"} 2.0
"""


def test_p99_is_the_nearest_rank() -> None:
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([5.0]) == 5.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0
    assert math.isnan(p99([]))


def test_prom_value_sums_a_series_over_its_labels() -> None:
    assert prom_value(METRICS, "etcd_mvcc_db_total_size_in_bytes") == 2097152.0
    assert prom_value(METRICS, "elastrain_jobs") == 10.0
    assert prom_value(METRICS, "elastrain_reconciler_pass_duration_seconds_count") == 30.0
    assert prom_value(METRICS, "etcd_debugging_mvcc_current_revision") is None


def test_by_label_sums_a_series_by_one_label() -> None:
    assert by_label(METRICS, "elastrain_etcd_requests_total", "op") == {"get": 8.0, "commit": 2.0}
    assert by_label(METRICS, "elastrain_jobs", "op") == {}


def test_per_pass_ms_is_the_mean_between_two_readings() -> None:
    assert per_pass_ms((1.0, 10.0), (3.0, 30.0)) == pytest.approx(100.0)
    assert math.isnan(per_pass_ms((1.0, 10.0), (1.0, 10.0)))


def test_cost_ratio_is_one_when_the_pass_grows_linearly() -> None:
    assert cost_ratio((100, 50.0), (1000, 500.0)) == pytest.approx(1.0)
    assert cost_ratio((100, 50.0), (1000, 1000.0)) == pytest.approx(2.0)


def test_history_is_the_retained_revisions_at_the_write_rate_at_most_the_horizon() -> None:
    assert history_s(10_000, 100.0) == pytest.approx(100.0)
    assert history_s(10_000, 1.0) == 3600.0
    assert history_s(10_000, 0.0) == 3600.0


def test_db_after_an_hour_stops_growing_at_the_compaction_retention() -> None:
    assert db_after(1e6, 1e3, retention_s=100.0) == pytest.approx(1.1e6)
    assert db_after(1e6, 1e3, retention_s=1e9) == pytest.approx(1e6 + 3.6e6)
    assert db_after(1e6, -5.0, retention_s=100.0) == 1e6


def test_a_jobs_ranks_share_its_checkpoint_rounds_one_per_period() -> None:
    index, began = checkpoint_round("job-a", 100.0, t0=0.0, period=10.0)
    assert began <= 100.0 < began + 10.0
    assert checkpoint_round("job-a", began, t0=0.0, period=10.0) == (index, began)
    assert checkpoint_round("job-a", began + 9.99, t0=0.0, period=10.0) == (index, began)
    assert checkpoint_round("job-a", began + 10.0, t0=0.0, period=10.0)[0] == index + 1
    phases = {checkpoint_round(f"job-{i}", 100.0, t0=0.0, period=10.0)[1] for i in range(20)}
    assert len(phases) > 1  # jobs' rounds are spread over the period, not all at once
