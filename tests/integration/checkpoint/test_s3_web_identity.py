"""Web identity (what EKS gives a pod whose ServiceAccount has an IAM role) against a real
server: SeaweedFS's STS answers AssumeRoleWithWebIdentity for a role that trusts an OIDC issuer
served by this test (its JWKS over HTTP, one RSA key). With only ``AWS_WEB_IDENTITY_TOKEN_FILE``,
``AWS_ROLE_ARN`` and the endpoint in the environment, the checkpoint storage resolves temporary
credentials (botocore's chain), hands them to obstore and to botocore's multipart calls, and
reads and writes the bucket; a token the issuer did not sign is refused (one line naming
``checkpoint.dir``).

The token is signed here with RSA PKCS#1 v1.5 over SHA-256 from Python's integers (the
environment has no JWT library); that is the issuer's side, not the product's."""

from __future__ import annotations

import base64
import hashlib
import json
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import botocore.session
import pytest

from service.ports import free_port
from tests.s3server import ACCESS_KEY, REGION, SECRET_KEY, SeaweedServer
from worker.checkpoint import storage
from worker.checkpoint.credentials import resolve
from worker.checkpoint.storage import S3Storage, check_reachable
from worker.errors import SpecError
from worker.jobspec.location import S3Location

pytestmark = pytest.mark.integration

AUDIENCE = "elastrain-test"
ROLE_ARN = "arn:aws:iam::role/CheckpointWriter"
AWS_VARS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
            "AWS_DEFAULT_REGION", "AWS_ALLOW_HTTP")  # fmt: skip
_DIGEST_INFO = bytes.fromhex("3031300d060960864801650304020105000420")  # SHA-256, PKCS#1


def _prime(bits: int, rng: random.Random) -> int:
    while True:
        n = rng.getrandbits(bits) | (1 << (bits - 1)) | 1
        if all(n % p for p in (3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)) and _probably_prime(n, rng):
            return n


def _probably_prime(n: int, rng: random.Random) -> bool:
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for _ in range(24):
        x = pow(rng.randrange(2, n - 2), d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


class Issuer:
    """An OIDC issuer: one 2048-bit RSA key, its JWKS over HTTP, RS256 tokens."""

    def __init__(self) -> None:
        rng = random.Random(7)
        while True:
            p, q = _prime(1024, rng), _prime(1024, rng)
            phi = (p - 1) * (q - 1)
            if phi % 65537:
                break
        self.n, self.e, self.d = p * q, 65537, pow(65537, -1, phi)
        self.url = f"http://127.0.0.1:{free_port()}"
        n, e = _b64(self.n.to_bytes(256, "big")), _b64(self.e.to_bytes(3, "big"))
        keys = {"keys": [{"kty": "RSA", "kid": "k1", "use": "sig", "alg": "RS256", "n": n, "e": e}]}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(keys).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", int(self.url.rsplit(":", 1)[1])), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def token(self, subject: str, *, d: int | None = None) -> str:
        now = int(time.time())
        claims = {"iss": self.url, "aud": AUDIENCE, "sub": subject, "iat": now, "exp": now + 600}
        head = _b64(json.dumps({"alg": "RS256", "typ": "JWT", "kid": "k1"}).encode())
        signed = f"{head}.{_b64(json.dumps(claims).encode())}"
        digest = _DIGEST_INFO + hashlib.sha256(signed.encode()).digest()
        block = b"\x00\x01" + b"\xff" * (256 - 3 - len(digest)) + b"\x00" + digest
        signature = pow(int.from_bytes(block, "big"), self.d if d is None else d, self.n)
        return f"{signed}.{_b64(signature.to_bytes(256, 'big'))}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _iam_config(issuer: Issuer) -> dict[str, object]:
    """SeaweedFS's advanced IAM: its STS, the issuer as an OIDC provider, one role it trusts."""
    statement = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
    return {
        "sts": {
            "tokenDuration": 3600 * 10**9,
            "maxSessionLength": 12 * 3600 * 10**9,
            "issuer": "seaweedfs-sts",
            "signingKey": base64.b64encode(b"elastrain-test-signing-key-32-by").decode(),
        },
        "policy": {"defaultEffect": "Deny", "storeType": "memory"},
        "roles": [
            {
                "roleName": "CheckpointWriter",
                "roleArn": ROLE_ARN,
                "attachedPolicies": ["Checkpoints"],
                "trustPolicy": {
                    "Version": "2012-10-17",
                    "Statement": [
                        {
                            "Effect": "Allow",
                            "Principal": {"Federated": issuer.url},
                            "Action": ["sts:AssumeRoleWithWebIdentity"],
                        }
                    ],
                },
            },
        ],
        "policies": [
            {
                "name": "Checkpoints",
                "document": {
                    "Version": "2012-10-17",
                    "Statement": [
                        statement,
                        {"Effect": "Allow", "Action": "sts:ValidateSession", "Resource": "*"},
                    ],
                },
            },
        ],
    }


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    issuer = Issuer()
    yield issuer
    issuer.http.shutdown()


@pytest.fixture(scope="module")
def sts_server(issuer: Issuer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    d = tmp_path_factory.mktemp("seaweed-sts")
    (d / "iam.json").write_text(json.dumps(_iam_config(issuer)))
    flags = (f"-s3.iam.config={d / 'iam.json'}", "-s3.iam.readOnly=false")
    with SeaweedServer(d, flags=flags) as server:
        iam = botocore.session.get_session().create_client(
            "iam", region_name=REGION, endpoint_url=server.endpoint,
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
        )  # fmt: skip
        iam.create_open_id_connect_provider(
            Url=issuer.url, ClientIDList=[AUDIENCE], ThumbprintList=["0" * 40]
        )
        yield server


@pytest.fixture
def web_identity(sts_server: SeaweedServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process sees the store through web identity only; returns the token file."""
    for name in AWS_VARS:
        monkeypatch.delenv(name, raising=False)
    token = tmp_path / "token"
    monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
    monkeypatch.setenv("AWS_ROLE_ARN", ROLE_ARN)
    monkeypatch.setenv("AWS_ROLE_SESSION_NAME", "elastrain-test")
    monkeypatch.setenv("AWS_ENDPOINT_URL", sts_server.endpoint)  # the store's STS too
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setattr(storage, "_stores", {})
    return token


def test_temporary_credentials_from_web_identity_read_and_write_the_bucket(
    web_identity: Path, issuer: Issuer
) -> None:
    web_identity.write_text(issuer.token("system:serviceaccount:train:worker"))
    assert resolve().method == "assume-role-with-web-identity"
    loc = S3Location("ckpt", "web-identity/a")
    check_reachable(loc)
    store = S3Storage("ckpt")
    store.write(loc.key("x"), b"state")
    assert store.read(loc.key("x")) == b"state"
    assert store.uploads(loc.prefix) == []  # botocore's multipart calls sign with the same role
    frozen = store.access.credentials()
    assert frozen["access_key_id"] not in (ACCESS_KEY, "") and frozen["token"]
    assert frozen["expires_at"] is not None  # asked again before the session ends


def test_a_token_the_issuer_did_not_sign_is_one_line_naming_the_field(
    web_identity: Path, issuer: Issuer
) -> None:
    web_identity.write_text(issuer.token("system:serviceaccount:train:worker", d=12345))
    with pytest.raises(SpecError, match=r"^field 'checkpoint\.dir': s3://ckpt/web-identity/b: ") as got:
        check_reachable(S3Location("ckpt", "web-identity/b"))
    line = str(got.value)
    assert "\n" not in line and "no credentials from assume-role-with-web-identity: " in line, line
    assert "signature is invalid" in line, line  # the store's STS checked it against the issuer's key
    assert "check AWS_ROLE_ARN and the token in AWS_WEB_IDENTITY_TOKEN_FILE" in line, line
