"""The one etcd client's pure parts, and the control plane's transaction built on them: how keys
travel, where a prefix ends, which endpoints are accepted, what a fenced commit compares."""

from __future__ import annotations

import base64

import pytest

from service.etcd.client import EtcdEndpoint, b64, range_end, unb64
from service.etcd.kv import Fence, Write, txn_body


def test_keys_travel_base64_and_a_prefix_ends_past_its_last_byte() -> None:
    assert b64("/elastrain/jobs/") == base64.b64encode(b"/elastrain/jobs/").decode()
    assert unb64(b64(b"\x00\xff")) == b"\x00\xff"
    assert range_end("/elastrain/jobs/") == "/elastrain/jobs0"
    assert range_end("a") == "b"


def test_endpoints_from_urls() -> None:
    assert EtcdEndpoint.from_url("http://etcd-0:2380").url == "http://etcd-0:2380"
    assert EtcdEndpoint.from_url("https://[::1]").url == "https://[::1]:2379"
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        EtcdEndpoint.from_url("etcd-0:2379")


def test_a_fenced_commit_compares_revisions_and_the_leader_key() -> None:
    fence = Fence("holder-a", 77)
    body = txn_body(
        [Write("/k", b"v", 0), Write("/m", b"w", 12, lease_id=5), Write("/p/", None, None, prefix=True)],
        fence,
    )
    compares = body["compare"]
    assert compares[0] == {"key": b64("/k"), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
    assert compares[1] == {"key": b64("/m"), "result": "EQUAL", "target": "MOD", "mod_revision": "12"}
    assert {c["target"] for c in compares[2:]} == {"VALUE", "LEASE"}
    assert all(c["key"] == b64(fence.key) for c in compares[2:])
    puts = [r["request_put"] for r in body["success"][:2]]
    assert "lease" not in puts[0] and puts[1]["lease"] == "5"
    assert body["success"][2] == {"request_delete_range": {"key": b64("/p/"), "range_end": b64("/p0")}}
