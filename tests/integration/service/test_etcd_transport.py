"""The etcd client's transport (worker/etcdclient.py: keep-alive ``http.client`` connections).

* A real etcd over TLS with client-certificate authentication (``--client-cert-auth``), its
  certificates made here with the ``openssl`` command: the client with the CA and its
  certificate reads and writes; without its certificate, or trusting another CA, it gets an
  ``EtcdUnavailableError`` that names the member and the TLS failure (never a traceback).
* A real etcd restarted under an idle client: the pooled connection the restart closed is not
  used again; the next request goes on a new one.
* A scripted grpc-gateway (a local HTTP server; a healthy single etcd cannot be made to answer
  503 or 504 on demand) for what failover does with each answer: a 503 (not applied) moves on to
  the next member; a 504 moves on only for a request that is safe to replay; a 200 that is not
  JSON is an error that names the member, not a traceback.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.etcd.server import EtcdServer
from worker.etcdclient import EtcdClient, EtcdEndpoint, EtcdTLS, EtcdUnavailableError, b64, put_request, unb64

pytestmark = pytest.mark.integration


def test_a_client_with_the_ca_and_its_certificate_reads_and_writes(tls_etcd: tuple[str, Path]) -> None:
    url, certs = tls_etcd
    client = EtcdClient([EtcdEndpoint.from_url(url)], tls=EtcdTLS(str(certs / "ca.crt"),
                        (str(certs / "client.crt"), str(certs / "client.key"))))  # fmt: skip
    try:
        client.put("/tls/a", b"over tls")
        for _ in range(3):  # again on the pooled connection: no new handshake needed, same answer
            (kv,) = client.range({"key": b64("/tls/a")})["kvs"]
            assert unb64(kv["value"]) == b"over tls"
    finally:
        client.close()


@pytest.mark.parametrize(
    ("ca", "cert", "says"),
    [
        ("ca.crt", None, "connection"),  # etcd refuses a client without a certificate
        # the server's certificate is not of the CA the client trusts
        ("other-ca.crt", ("client.crt", "client.key"), "CERTIFICATE_VERIFY_FAILED"),
    ],
    ids=["no-client-certificate", "another-ca"],
)
def test_a_tls_mismatch_is_one_clear_error(
    tls_etcd: tuple[str, Path], ca: str, cert: tuple[str, str] | None, says: str
) -> None:
    url, certs = tls_etcd
    pair = (str(certs / cert[0]), str(certs / cert[1])) if cert else None
    client = EtcdClient([EtcdEndpoint.from_url(url)], tls=EtcdTLS(str(certs / ca), pair), timeout_s=3)
    with pytest.raises(EtcdUnavailableError) as caught:
        client.put("/tls/b", b"x")
    message = str(caught.value)
    assert url in message and says in message and "check that etcd is running" in message, message


def test_a_connection_closed_while_idle_is_not_used_again(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    with server:
        client = EtcdClient([EtcdEndpoint.from_url(server.endpoint)])
        client.put("/idle/a", b"1")
    with server:  # the same ports: the client's pooled connection was closed by the old process
        client.put("/idle/a", b"2")
        (kv,) = client.range({"key": b64("/idle/a")})["kvs"]
        assert unb64(kv["value"]) == b"2"
    client.close()


class _Gateway(http.server.ThreadingHTTPServer):
    """Answers every POST with ``status`` and ``body``, and counts them."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body, self.posts = status, body, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                gateway = self.server
                assert isinstance(gateway, _Gateway)
                self.rfile.read(int(self.headers["Content-Length"]))
                gateway.posts += 1
                self.send_response(gateway.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(gateway.body)))
                self.end_headers()
                self.wfile.write(gateway.body)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def endpoint(self) -> EtcdEndpoint:
        return EtcdEndpoint("http", "127.0.0.1", self.server_address[1])


@pytest.fixture
def gateways() -> Iterator[list[_Gateway]]:
    made: list[_Gateway] = []
    yield made
    for gateway in made:
        gateway.shutdown()
        gateway.server_close()


OK = json.dumps({"header": {"revision": "7"}}).encode()


@pytest.mark.parametrize(
    ("status", "replay_safe", "second_asked"),
    [(503, False, True), (504, True, True), (504, False, False), (408, False, False)],
)
def test_what_failover_does_with_an_unavailable_answer(
    gateways: list[_Gateway], status: int, replay_safe: bool, second_asked: bool
) -> None:
    first, second = _Gateway(status, b'{"error":"etcdserver: request timed out"}'), _Gateway(200, OK)
    gateways += [first, second]
    client = EtcdClient([first.endpoint, second.endpoint])
    body = {"compare": [], "success": [{"request_put": put_request("/k", b"v")}]}
    if second_asked:
        assert client.txn(body, replay_safe=replay_safe) == {"header": {"revision": "7"}}
    else:
        with pytest.raises(EtcdUnavailableError, match=f"HTTP {status}"):
            client.txn(body, replay_safe=replay_safe)
    assert (first.posts, second.posts) == (1, int(second_asked))


def test_an_answer_that_is_not_json_names_the_member(gateways: list[_Gateway]) -> None:
    gateway = _Gateway(200, b"<html>a proxy's page</html>")
    gateways.append(gateway)
    client = EtcdClient([gateway.endpoint])
    with pytest.raises(EtcdUnavailableError, match="not JSON") as caught:
        client.range({"key": b64("/k")})
    assert gateway.endpoint.url in str(caught.value)
