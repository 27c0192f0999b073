"""The etcd-v3 rendezvous's pure parts: settings, endpoints, txn shapes."""

from __future__ import annotations

import base64

import pytest

from service.rendezvous.config import (
    RendezvousConfig,
    RendezvousConfigError,
    parse_config,
    parse_endpoints,
    rdzv_conf_arg,
)
from service.rendezvous.kv import KeyValue, all_exist_txn, cas_txn, parse_cas


def test_defaults_are_the_documented_choices() -> None:
    config = parse_config({})
    assert (config.last_call_timeout, config.keep_alive_interval, config.keep_alive_max_attempt) == (
        3.0,
        2.0,
        3,
    )
    assert config.join_timeout == 600.0 and config.state_ttl == 600


def test_config_reads_torchrun_strings_and_ignores_its_own_keys() -> None:
    config = parse_config(
        {"last_call_timeout": "0.5", "keep_alive_max_attempt": "5", "timeout": "900", "rank": "0"}
    )
    assert config.last_call_timeout == 0.5 and config.keep_alive_max_attempt == 5


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"last_cal_timeout": "1"}, "unknown --rdzv-conf key 'last_cal_timeout'"),
        ({"join_timeout": "soon"}, "not a number"),
        ({"join_timeout": "0"}, "positive"),
        ({"state_ttl": "3"}, "at least 5 keep-alive"),
        ({"key_prefix": "rdzv/"}, "absolute key"),
        ({"cert_file": "c.pem"}, "both cert_file and key_file"),
        ({"protocol": "grpc"}, "http or https"),
    ],
)
def test_config_refuses_nonsense_with_a_fix(raw: dict[str, str], message: str) -> None:
    with pytest.raises(RendezvousConfigError, match=message):
        parse_config(raw)


def test_conf_arg_round_trips() -> None:
    config = RendezvousConfig(last_call_timeout=1.5, state_ttl=120)
    parsed = parse_config(dict(kv.split("=", 1) for kv in rdzv_conf_arg(config).split(",")))
    assert parsed == config


def test_keys_live_under_one_prefix_per_run() -> None:
    config = RendezvousConfig()
    assert config.state_key("job-1") == "/elastrain/rdzv/job-1/state"
    assert config.store_prefix("job-1") == "/elastrain/rdzv/job-1/store/"
    with pytest.raises(RendezvousConfigError):
        config.state_key("a/b")


def test_endpoints_accept_urls_hosts_and_lists() -> None:
    parsed = parse_endpoints("http://127.0.0.1:2379, etcd-1 ,https://[::1]:2380")
    assert [e.url for e in parsed] == ["http://127.0.0.1:2379", "http://etcd-1:2379", "https://[::1]:2380"]
    assert parse_endpoints("h:1", default_protocol="https")[0].url == "https://h:1"


def test_a_url_with_a_path_is_the_services_gateway() -> None:
    (gateway,) = parse_endpoints("http://svc:8080/v1/jobs/j/kv")
    assert gateway.gateway and gateway.url == "http://svc:8080/v1/jobs/j/kv"


@pytest.mark.parametrize("bad", ["", " , ", "ftp://h:1", "h:port", "h:0", "h:1/v3", "ftp://h/x"])
def test_bad_endpoints_are_refused(bad: str) -> None:
    with pytest.raises(RendezvousConfigError):
        parse_endpoints(bad)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_cas_txn_compares_mod_revision_or_absence() -> None:
    first = cas_txn("/k", b"v", None, lease=7)
    assert first["compare"] == [
        {"key": b64("/k"), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
    ]
    assert first["success"][0]["request_put"] == {"key": b64("/k"), "value": b64("v"), "lease": "7"}
    later = cas_txn("/k", b"v", 41, lease=None)
    assert later["compare"][0]["target"] == "MOD" and later["compare"][0]["mod_revision"] == "41"
    assert "lease" not in later["success"][0]["request_put"]
    assert later["failure"] == [{"request_range": {"key": b64("/k")}}]


def test_parse_cas_reads_success_conflict_and_absence() -> None:
    assert parse_cas({"succeeded": True, "header": {"revision": "12"}}, b"new") == (
        True,
        KeyValue(b"new", 12),
    )
    conflict = {
        "header": {"revision": "13"},
        "responses": [{"response_range": {"kvs": [{"value": b64("old"), "mod_revision": "9"}]}}],
    }
    assert parse_cas(conflict, b"new") == (False, KeyValue(b"old", 9))
    assert parse_cas({"header": {"revision": "13"}, "responses": [{"response_range": {}}]}, b"new") == (
        False,
        None,
    )


def test_all_exist_txn_checks_every_key() -> None:
    txn = all_exist_txn(["/a", "/b"])
    assert [c["key"] for c in txn["compare"]] == [b64("/a"), b64("/b")]
    assert all(c["target"] == "CREATE" and c["result"] == "GREATER" for c in txn["compare"])
