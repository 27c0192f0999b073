"""The key-value gateway's checks, on plain values: operations, keys (txns included), fields,
leases and budgets."""

from __future__ import annotations

from typing import Any

import pytest

from service.etcd.gateway_budget import (
    BURST_S,
    KvBudget,
    LeaseLedger,
    Usage,
    WriteRate,
    admit_write,
    check_grant,
    check_leases,
    usage_of,
)
from service.etcd.gateway_rules import Checked, GatewayRefused, Put, check_request, prefix_end
from service.settings import Settings
from worker.etcdclient import b64, range_end

MINE = "/elastrain/rdzv/job-a/"
BUDGET = KvBudget(
    job_bytes=1000, job_keys=4, request_bytes=300, job_leases=2, lease_ttl_s=600, total_bytes=5000,
    write_bytes_per_s=100,
)  # fmt: skip


def refused(op: str, body: dict[str, Any]) -> GatewayRefused:
    with pytest.raises(GatewayRefused) as caught:
        check_request(op, body, MINE)
    return caught.value


def put(key: str, value: bytes = b"v", **extra: Any) -> dict[str, Any]:
    return {"key": b64(key), "value": b64(value), **extra}


@pytest.mark.parametrize(
    "op", ["maintenance/alarm", "auth/enable", "auth/role/grant", "auth/authenticate", "lease/leases",
           "lease/timetolive", "kv/compaction", "watch", "cluster/member/list"],
)  # fmt: skip
def test_every_other_operation_is_refused_with_the_ones_served(op: str) -> None:
    exc = refused(op, {})
    assert exc.status == 404 and "kv/range" in exc.message and op in exc.message


def test_keys_inside_the_prefix_pass_and_puts_are_counted() -> None:
    checked = check_request("kv/put", put(MINE + "state", b"x" * 10, lease="7"), MINE)
    assert checked == Checked(leases=(7,), puts=(Put((MINE + "state").encode(), len(MINE) + 5 + 10),))
    whole = {"key": b64(MINE), "range_end": b64(range_end(MINE))}
    assert check_request("kv/range", whole, MINE).puts == ()
    assert check_request("kv/deleterange", whole, MINE).puts == ()


@pytest.mark.parametrize(
    "body",
    [
        {"key": b64("/elastrain/config/worker-secret")},
        {"key": b64("/elastrain/rdzv/job-b/state")},
        {"key": b64("/elastrain/rdzv/job-a")},  # the prefix without its '/' is job-ab's too
        {"key": b64(MINE), "range_end": b64("\0")},  # everything after the key
        {"key": b64(MINE), "range_end": b64("/elastrain/rdzv/job-b/")},
        {"key": b64(MINE + "x"), "range_end": b64(MINE)},  # below the prefix's start: ends inside nothing
    ],
)
def test_a_range_reaching_outside_the_prefix_is_refused_naming_it(body: dict[str, Any]) -> None:
    exc = refused("kv/range", body)
    assert exc.status == 403 and MINE in exc.message


def test_every_key_of_a_txn_is_checked_nested_ones_too() -> None:
    inside = {"key": b64(MINE + "k"), "result": "EQUAL", "target": "MOD", "mod_revision": "3"}
    ok = {
        "compare": [inside],
        "success": [{"request_put": put(MINE + "k")}],
        "failure": [{"request_range": {"key": b64(MINE + "k")}}],
    }
    assert len(check_request("kv/txn", ok, MINE).puts) == 1
    outside = "/elastrain/jobs/other"
    bad_compare = ok | {"compare": [inside | {"key": b64(outside)}]}
    bad_failure = ok | {"failure": [{"request_delete_range": {"key": b64(outside)}}]}
    nested = ok | {"success": [{"request_txn": {"success": [{"request_put": put(outside)}]}}]}
    for body in (bad_compare, bad_failure, nested):
        assert refused("kv/txn", body).status == 403


def test_fields_are_allow_listed_so_etcds_other_spellings_cannot_slip_past() -> None:
    exc = refused("kv/range", {"key": b64(MINE), "rangeEnd": b64("\0")})
    assert exc.status == 422 and "rangeEnd" in exc.message
    assert refused("kv/txn", {"success": [{"requestPut": put("/x")}]}).status == 422
    assert refused("kv/put", {"key": "not base64!", "value": ""}).status == 422
    assert refused("lease/grant", {"TTL": 10, "ID": "42"}).status == 403  # etcd picks the id


def test_a_txn_both_branches_puts_count_for_the_budget() -> None:
    body = {
        "success": [{"request_put": put(MINE + "a", b"1" * 100)}],
        "failure": [{"request_put": put(MINE + "b", b"2" * 100)}],
    }
    assert check_request("kv/txn", body, MINE).written_bytes == 2 * (len(MINE) + 1 + 100)


def test_leases_must_be_the_jobs_own() -> None:
    ledger = LeaseLedger()
    ledger.grant("job-a", 7, expires_at=100.0)
    ledger.grant("job-b", 8, expires_at=100.0)
    check_leases("job-a", (7,), ledger)
    for lease in (8, 9):
        with pytest.raises(GatewayRefused) as caught:
            check_leases("job-a", (lease,), ledger)
        assert caught.value.status == 403 and str(lease) in caught.value.message
    assert list(ledger.unknown([7, 8, 9])) == [9]
    ledger.forget(7)
    assert ledger.owner(7) is None


def test_a_grant_is_bounded_in_ttl_and_in_count_and_expired_leases_free_room() -> None:
    ledger = LeaseLedger()
    with pytest.raises(GatewayRefused, match="lease_ttl_s"):
        check_grant("job-a", 601, ledger, BUDGET, now=0.0)
    ledger.grant("job-a", 1, expires_at=10.0)
    ledger.grant("job-a", 2, expires_at=20.0)
    with pytest.raises(GatewayRefused, match="job_leases"):
        check_grant("job-a", 60, ledger, BUDGET, now=5.0)
    check_grant("job-a", 60, ledger, BUDGET, now=15.0)  # lease 1 expired
    ledger.refresh(2, expires_at=40.0)
    assert ledger.live("job-a", now=30.0) == 1


def test_writes_within_the_budget_pass_and_a_fill_is_refused_naming_the_budget() -> None:
    one = Checked(puts=(Put(b"k", 200),))
    admit_write(one, usage=Usage(700, 2), others_bytes=0, budget=BUDGET)
    cases = {
        "job_bytes": dict(usage=Usage(900, 1), others_bytes=0),
        "job_keys": dict(usage=Usage(0, 4), others_bytes=0),
        "total_bytes": dict(usage=Usage(0, 0), others_bytes=4900),
    }
    for name, given in cases.items():
        with pytest.raises(GatewayRefused) as caught:
            admit_write(one, budget=BUDGET, **given)  # type: ignore[arg-type]
        assert caught.value.status == 413 and f"kv budget {name}" in caught.value.message
    with pytest.raises(GatewayRefused, match="request_bytes"):
        admit_write(Checked(puts=(Put(b"k", 301),)), usage=Usage(), others_bytes=0, budget=BUDGET)


def test_the_global_write_rate_refills_with_time() -> None:
    rate = WriteRate(rate=100.0, tokens=150.0, at=0.0)
    rate.take(150, now=0.0)
    with pytest.raises(GatewayRefused) as caught:
        rate.take(50, now=0.1)
    assert caught.value.status == 429 and "write_bytes_per_s" in caught.value.message
    rate.take(50, now=1.0)


def test_usage_is_read_from_a_range_answer_and_prefix_end_is_exclusive() -> None:
    kvs = [{"key": b64(MINE + "a"), "value": b64(b"12345")}, {"key": b64(MINE + "b")}]
    assert usage_of(kvs) == Usage(2 * (len(MINE) + 1) + 5, 2)
    assert prefix_end(MINE.encode()) == range_end(MINE).encode()
    assert prefix_end(b"a\xff") == b"b"


def test_the_largest_budgets_allowed_cannot_fill_etcds_default_quota() -> None:
    """What jobs can keep plus what their overwrites leave until etcd compacts (every 5 minutes,
    a burst of 30 s on top) stays under half of etcd's 2 GiB default quota."""
    fields = Settings.model_fields
    names = ("kv_total_bytes", "kv_write_bytes_per_s")
    most = {name: next(m.le for m in fields[name].metadata if hasattr(m, "le")) for name in names}
    assert most["kv_total_bytes"] + most["kv_write_bytes_per_s"] * (300 + BURST_S) <= (2 << 30) // 2
    budget = KvBudget.from_settings(Settings())
    assert budget.job_bytes < budget.total_bytes and budget.request_bytes <= budget.job_bytes
