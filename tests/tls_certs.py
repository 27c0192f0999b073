"""Certificates for TLS tests, made with the ``openssl`` command (no network, two seconds)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def make_certs(directory: Path) -> Path:
    """In ``directory``: a CA (``ca.crt``/``.key``), another CA (``other-ca``), a server
    certificate of the first for 127.0.0.1 (``server``) and a client certificate of it
    (``client``). Returns ``directory``."""
    if shutil.which("openssl") is None:
        pytest.fail("this test makes its certificates with the openssl command: apt-get install openssl")
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    # clientAuth too: etcd's grpc-gateway dials etcd's own gRPC server with this certificate
    _signed(
        directory, "ca", "server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    _signed(directory, "ca", "client", "extendedKeyUsage=clientAuth\n")
    return directory


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(directory: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", cwd=directory)  # fmt: skip


def _signed(directory: Path, ca: str, name: str, extensions: str) -> None:
    (directory / f"{name}.ext").write_text(extensions)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=directory)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt",
             cwd=directory)  # fmt: skip
