"""The one etcd client's pure parts, and the control plane's transaction built on them: how keys
travel, where a prefix ends, which endpoints are accepted, what a fenced commit compares."""

from __future__ import annotations

import base64

import pytest

from service.etcd.kv import Fence, Write, txn_body
from worker.etcdclient import (
    Credentials,
    EtcdClient,
    EtcdEndpoint,
    EtcdTLS,
    EtcdUnavailableError,
    b64,
    gateway_bearer,
    range_end,
    token_refused,
    unb64,
)


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


def test_a_password_never_shows_in_a_repr() -> None:
    credentials = Credentials("elastrain-job-a", "s3cret-value")
    assert "s3cret-value" not in repr(credentials) and "elastrain-job-a" in repr(credentials)


@pytest.mark.parametrize(
    ("detail", "again"),
    [
        ('{"error":"etcdserver: invalid auth token","code":16}', True),
        ('{"error":"etcdserver: revision of auth store is old","code":3}', True),
        # seen when another job's user was created meanwhile (a real service, two jobs)
        (
            '{"error":"auth: revision in header is old","code":2}',
            True,
        ),
        ('{"error":"etcdserver: user name is empty","code":3}', True),
        ('{"error":"etcdserver: permission denied","code":7}', False),
        ('{"error":"etcdserver: requested lease not found","code":5}', False),
    ],
)
def test_a_request_refused_for_its_token_goes_again_with_a_new_one(detail: str, again: bool) -> None:
    assert token_refused(detail) is again


def test_a_gateway_endpoint_is_a_url_with_a_path_and_takes_the_worker_token() -> None:
    gateway = EtcdEndpoint.from_url("http://svc:8080/v1/jobs/j/kv/")
    assert (gateway.gateway, gateway.path, gateway.port) == (True, "/v1/jobs/j/kv", 8080)
    assert gateway.url == "http://svc:8080/v1/jobs/j/kv"
    member = EtcdEndpoint.from_url("http://e:2379")
    assert (member.gateway, member.path) == (False, "/v3")
    assert gateway_bearer([gateway], {"ELASTRAIN_WORKER_TOKEN": "ewk.j.x"}) == "ewk.j.x"
    assert gateway_bearer([member], {"ELASTRAIN_WORKER_TOKEN": "ewk.j.x"}) is None
    with pytest.raises(ValueError, match="ELASTRAIN_WORKER_TOKEN"):
        gateway_bearer([gateway], {})
    with pytest.raises(ValueError, match="not both"):
        gateway_bearer([gateway, member], {"ELASTRAIN_WORKER_TOKEN": "t"})


@pytest.mark.parametrize(
    ("ca_cert", "cert", "names"),
    [
        ("/gone/ca.crt", None, "/gone/ca.crt"),
        (None, ("/gone/c.crt", "/gone/c.key"), "/gone/c.crt, /gone/c.key"),
    ],
    ids=["ca", "client-certificate"],
)
def test_tls_files_that_do_not_load_are_one_error_naming_them(
    ca_cert: str | None, cert: tuple[str, str] | None, names: str
) -> None:
    """A node whose TLS files are not where the service said (a pod without the mount): one line
    naming them, not an OSError's traceback. Nothing is sent: the files load before any request."""
    with pytest.raises(EtcdUnavailableError, match=f"TLS to etcd: {names} does not load: .*No such file"):
        EtcdClient([EtcdEndpoint.from_url("https://etcd:2379")], tls=EtcdTLS(ca_cert, cert))
    EtcdClient(
        [EtcdEndpoint.from_url("http://etcd:2379")], tls=EtcdTLS("/gone/ca.crt")
    ).close()  # plain http: unused
