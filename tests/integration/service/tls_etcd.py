"""A real etcd that speaks only TLS and asks every client for a certificate of its CA
(``--client-cert-auth``), its certificates made with the ``openssl`` command: the fixture
:func:`tls_etcd` (module-scoped), for the etcd client's transport tests and the service's."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.etcd.server import find_etcd_binary
from service.ports import free_port
from tests.tls_certs import make_certs
from worker.etcdclient import EtcdClient, EtcdEndpoint, EtcdTLS, EtcdUnavailableError, b64


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real etcd serving https on 127.0.0.1 that asks every client for a certificate of its CA."""
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    data = tmp_path_factory.mktemp("etcd-tls")
    client_port, peer_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    url = f"https://127.0.0.1:{client_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    log = open(data / "etcd.log", "wb")  # noqa: SIM115 - handed to the child, closed below
    proc = subprocess.Popen(
        [find_etcd_binary(), "--name=tls", f"--data-dir={data / 'member'}", f"--listen-client-urls={url}",
         f"--advertise-client-urls={url}", f"--listen-peer-urls={peer}",
         f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=tls={peer}",
         f"--cert-file={certs / 'server.crt'}", f"--key-file={certs / 'server.key'}",
         f"--trusted-ca-file={certs / 'ca.crt'}", "--client-cert-auth", "--log-level=warn"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    log.close()
    try:
        client = EtcdClient([EtcdEndpoint.from_url(url)], tls=EtcdTLS(str(certs / "ca.crt"),
                            (str(certs / "client.crt"), str(certs / "client.key"))))  # fmt: skip
        deadline = time.monotonic() + 30
        while True:  # until it serves (a second or two)
            try:
                client.range({"key": b64("/ready")})
                break
            except EtcdUnavailableError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (data / "etcd.log").read_text()[-2000:]
                    pytest.fail(f"etcd over TLS does not serve: {exc}\n{tail}")
                time.sleep(0.05)
        client.close()
        yield url, certs
    finally:
        proc.terminate()
        proc.wait(10)
